"""The Dockerfile reader of the Cloud Build emulator and the argv a built image runs: tables of
Dockerfiles, what they give, and what ``docker build`` says of the ones it rejects."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cloud_run_emulator.build_steps import docker_build_args, image_entry, local_argv
from cloud_run_emulator.dockerfile import DockerfileError, ImageConfig, parse_dockerfile

REPO = Path(__file__).resolve().parents[2]

PARSED = [
    ("exec form", 'FROM x\nENTRYPOINT ["python", "-m", "w"]\nCMD ["train"]',
     ImageConfig(("python", "-m", "w"), ("train",))),
    ("shell form", "FROM x\nCMD echo hi there", ImageConfig((), ("/bin/sh", "-c", "echo hi there"))),
    ("lowercase, continuation, comments", 'from x\n# note\nentrypoint ["a", \\\n  "b"]\n',
     ImageConfig(("a", "b"))),
    ("WORKDIR relative to the one before", "FROM x\nWORKDIR /src\nWORKDIR app\nWORKDIR ../lib",
     ImageConfig(workdir="/src/lib")),
    ("ENV forms; values expand from before", 'FROM x\nENV A=1 B="two words"\nENV C ${A}/$B\nWORKDIR /$A',
     ImageConfig(workdir="/1", env=(("A", "1"), ("B", "two words"), ("C", "1/two words")))),
    ("ARG before FROM expands", "ARG D=/data\nFROM x\nWORKDIR ${D}/in", ImageConfig(workdir="/data/in")),
    ("a stage starts from the one it names", 'FROM x AS base\nCMD ["c"]\nWORKDIR /w\nFROM base\nENTRYPOINT ["e"]',
     ImageConfig(("e",), (), "/w")),
    ("a CMD of the same stage stays under a later ENTRYPOINT", 'FROM x\nCMD ["c"]\nENTRYPOINT ["e"]',
     ImageConfig(("e",), ("c",))),
    ("the last stage is the image", 'FROM x AS build\nCMD ["b"]\nFROM y\nCMD ["final"]', ImageConfig((), ("final",))),
    ("a non-JSON bracket is shell form", "FROM x\nCMD [oops", ImageConfig((), ("/bin/sh", "-c", "[oops"))),
]


@pytest.mark.parametrize("text, expected", [c[1:] for c in PARSED], ids=[c[0] for c in PARSED])
def test_parse_dockerfile(text, expected):
    assert parse_dockerfile(text) == expected


REJECTED = [
    ("empty", "# nothing\n\n", "cannot be empty"),
    ("unknown instruction", "FROM x\nRUNN make", "line 2: unknown instruction: RUNN"),
    ("before FROM", "WORKDIR /x\nFROM y", "line 1: no build stage in current context"),
    ("FROM without image", "FROM", "FROM requires either one or three arguments"),
    ("FROM with two words", "FROM a b", "FROM requires either one or three arguments"),
    ("array of non-strings", "FROM x\nCMD [1, 2]", "CMD array must hold strings only"),
    ("ENV without value", "FROM x\nENV ONLY", "ENV must have two arguments"),
    ("ENV word without =", "FROM x\nENV A=1 B", "'B' is not of the form KEY=VALUE"),
    ("WORKDIR without path", "FROM x\nWORKDIR", "WORKDIR requires exactly one argument"),
]


@pytest.mark.parametrize("text, message", [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_rejected_dockerfiles_name_the_line_and_rule(text, message):
    with pytest.raises(DockerfileError, match=message):
        parse_dockerfile(text)


def test_the_worker_dockerfile_gives_the_bundled_workers_command():
    config = parse_dockerfile((REPO / "worker" / "Dockerfile").read_text())
    assert config.entrypoint == ("python", "-m", "gpu_resilience_trainer")
    assert (config.cmd, config.workdir) == (("train",), "/src")
    assert config.environment["CHECKPOINT_DIR"] == "/checkpoints"


@pytest.mark.parametrize("args, tags, dockerfile, context", [
    (["build", "-t", "a:1", "."], ("a:1",), None, "."),
    (["build", "--tag=a", "--tag", "b", "-f", "docker/Dockerfile", "--no-cache", "src"], ("a", "b"),
     "docker/Dockerfile", "src"),
    (["build", "--network=cloudbuild", "--build-arg", "X=1", "."], (), None, "."),
])
def test_docker_build_args(args, tags, dockerfile, context):
    spec = docker_build_args(args)
    assert (spec.tags, spec.dockerfile, spec.context) == (tags, dockerfile, context)


@pytest.mark.parametrize("args, message", [(["build"], "exactly 1 argument"), (["build", "a", "b"], "exactly 1"),
                                           (["build", ".", "-t"], "flag needs an argument: -t")])
def test_docker_build_args_rejected(args, message):
    with pytest.raises(ValueError, match=message):
        docker_build_args(args)


def test_a_built_image_runs_the_emulators_python_in_its_context(tmp_path):
    assert local_argv(("python3.12", "/app/run.py", "/etc/x"), "/app", tmp_path) == (
        sys.executable, str(tmp_path / "run.py"), "/etc/x")
    assert local_argv(("python",), "/app", tmp_path, program=False) == ("python",)
    entry = image_entry(ImageConfig(("/usr/bin/python3", "-m", "w"), ("train",), "/src", (("A", "1"),)), tmp_path)
    assert entry.argv([], []) == [sys.executable, "-m", "w", "train"]
    assert (entry.cwd, entry.env, entry.workdir) == (tmp_path.resolve(), {"A": "1"}, "/src")

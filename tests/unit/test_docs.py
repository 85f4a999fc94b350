"""The documentation's code is code the tests run, and its pages say no more than the code does.

- Every ``literalinclude`` under ``docs/`` takes its code from a file the tests run (the example
  DAGs, ``docs/examples/``, the user image, the demo script), between ``[START name]`` and
  ``[END name]`` markers that exist in that file, once each: renaming or deleting a marker fails
  here, not silently in the built page (Sphinx only warns about a missing marker).
- No other code block shows Python: every Python example is included from such a file. A shell
  block may hold only the commands of :data:`ALLOWED_SHELL`; other blocks are ``text`` (output,
  diagrams), and there is no bare ``::`` block whose language a reader could not tell.
- Every marker in those files is paired and shown somewhere (no dead markers).

Pure file reading: no Sphinx, no Airflow (``make docs`` builds the site; ``-n -W`` checks the
cross-references).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
EXAMPLES_DIR = DOCS / "examples"

#: Where an included file may come from: the files the tests run (``tests/system/test_dags.py``
#: runs the DAGs, ``tests/system/test_docs_examples.py`` and the worker tests run
#: ``docs/examples/``, ``tests/system/test_user_image.py`` the user image, ``tests/system/test_demo.py``
#: the demo).
INCLUDABLE = ("dags/*.py", "docs/examples/*", "examples/user-image/*", "scripts/demo.py")

#: The only lines a shell block may hold: commands the reader runs as written, each run by
#: ``make``'s own targets or by CI (``.ci/run``), or a ``gcloud`` step of the real-Cloud-Run set-up
#: that no test here can run (no Google Cloud from this machine), listed one by one so that a new
#: one is a decision.
ALLOWED_SHELL = frozenset({
    "make demo",
    "make test",
    "make docs",
    "make stack",
    "make test-airflow2",
    "make check-install",
    "make bench",
    "pip install ./worker",
    "EMULATOR_FUSE_STRICT=1 make demo",
    # the emulator's command line; test_the_emulator_command_lines_parse checks its flags
    "python -m cloud_run_emulator serve --port 8123 --grpc-port 8124 --gcs-port 9023 "
    "--data-dir /tmp/emulator --images worker/emulator-image.json",
    "gcloud iam service-accounts create gpu-trainer",
    "gcloud artifacts repositories create ml --repository-format=docker --location=us-central1",
    "gcloud builds submit worker/ --tag us-central1-docker.pkg.dev/PROJECT/ml/airflow-gpu-resilience-worker:latest",
})
SHELL_LANGUAGES = {"bash", "sh", "shell", "console", "shell-session"}

_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\.[ \t]+(?P<name>[\w:-]+)::[ \t]*(?P<arg>.*)$")
_OPTION = re.compile(r"^[ \t]+:(?P<name>[\w-]+):[ \t]*(?P<value>.*)$")
_MARKER = re.compile(r"\[(?P<kind>START|END) (?P<name>[\w.-]+)\]")


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.rst") if "_build" not in p.parts)


def _directives(page: Path) -> list[dict]:
    """Every directive of ``page``: name, argument, options, body lines and line number."""
    lines = page.read_text().splitlines()
    found = []
    for number, line in enumerate(lines):
        match = _DIRECTIVE.match(line)
        if not match:
            continue
        indent = len(match["indent"])
        options, body, index = {}, [], number + 1
        while index < len(lines) and (option := _OPTION.match(lines[index])):
            options[option["name"]] = option["value"].strip()
            index += 1
        while index < len(lines) and (not lines[index].strip()
                                      or len(lines[index]) - len(lines[index].lstrip()) > indent):
            body.append(lines[index])
            index += 1
        found.append({"name": match["name"], "arg": match["arg"].strip(), "options": options,
                      "body": [line for line in body if line.strip()], "line": number + 1, "page": page})
    return found


def _included_path(directive: dict, repo: Path = REPO) -> Path:
    """The file a ``literalinclude`` names: from the source folder (``docs/``) when absolute, else
    from its page."""
    arg = directive["arg"]
    return (repo / "docs" / arg.lstrip("/")) if arg.startswith("/") else (directive["page"].parent / arg)


def _where(directive: dict, repo: Path = REPO) -> str:
    return f"{directive['page'].relative_to(repo)}:{directive['line']}"


def _includes() -> list[dict]:
    return [d for page in _pages() for d in _directives(page) if d["name"] == "literalinclude"]


def _markers(path: Path) -> dict[tuple[str, str], list[int]]:
    """``{(kind, name): [line numbers]}`` of the ``[START name]``/``[END name]`` comments in ``path``."""
    found: dict[tuple[str, str], list[int]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        for match in _MARKER.finditer(line):
            if line.lstrip().startswith("#"):
                found.setdefault((match["kind"], match["name"]), []).append(number)
    return found


def include_problems(directive: dict, repo: Path = REPO) -> list[str]:
    """What is wrong with one ``literalinclude``: a file outside :data:`INCLUDABLE`, a missing
    file, a missing or repeated marker, an END before its START.

    :param directive: as :func:`_directives` returns it.
    :param repo: the repository the page is in.
    :return: one message per problem, naming the page and line; empty when it is right.
    """
    where, path = _where(directive, repo), _included_path(directive, repo)
    if not path.is_file():
        return [f"{where}: {directive['arg']} does not exist"]
    relative = path.resolve().relative_to(repo.resolve()).as_posix()
    if not any(Path(relative).match(pattern) for pattern in INCLUDABLE):
        return [f"{where}: {relative} is not a file the tests run (INCLUDABLE: {', '.join(INCLUDABLE)})"]
    start, end = directive["options"].get("start-after"), directive["options"].get("end-before")
    if start is None and end is None:
        return []
    start_match, end_match = _MARKER.fullmatch(start or ""), _MARKER.fullmatch(end or "")
    if not (start_match and end_match and start_match["kind"] == "START" and end_match["kind"] == "END"
            and start_match["name"] == end_match["name"]):
        return [f"{where}: use :start-after: [START name] and :end-before: [END name] (got {start!r}, {end!r})"]
    markers, name = _markers(path), start_match["name"]
    problems = [f"{where}: [{kind} {name}] is in {relative} {len(markers.get((kind, name), []))} times, not once"
                for kind in ("START", "END") if len(markers.get((kind, name), [])) != 1]
    if not problems and markers[("END", name)][0] < markers[("START", name)][0]:
        problems.append(f"{where}: [END {name}] comes before [START {name}] in {relative}")
    return problems


def block_problems(directive: dict) -> list[str]:
    """What is wrong with one code block: Python not included from a tested file, a shell line
    outside :data:`ALLOWED_SHELL`, a block without a language.

    :param directive: a ``code-block``, ``code`` or ``sourcecode`` directive.
    :return: one message per problem; empty when it is right.
    """
    where, language = _where(directive), directive["arg"].lower()
    if not language:
        return [f"{where}: a code block names its language (text for output and diagrams)"]
    if language in SHELL_LANGUAGES:
        commands = [line.strip() for line in directive["body"] if not line.strip().startswith("#")]
        return [f"{where}: shell line {line!r} is not in ALLOWED_SHELL" for line in commands
                if line not in ALLOWED_SHELL]
    if language != "text":
        return [f"{where}: a {language} block must be included from a file the tests run (literalinclude)"]
    return []


def _bare_literal_blocks(page: Path) -> list[str]:
    """Lines ending in ``::`` that open a literal block (not a directive): it has no language."""
    problems = []
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if line.rstrip().endswith("::") and not _DIRECTIVE.match(line) and not line.lstrip().startswith(".."):
            problems.append(f"{page.relative_to(REPO)}:{number}: a bare '::' literal block; "
                            "use .. code-block:: LANGUAGE")
    return problems


def test_the_docs_have_pages() -> None:
    """The checks below read something: the site's pages are where this test looks."""
    assert (DOCS / "index.rst").is_file() and len(_pages()) > 10


def test_every_included_file_is_tested_and_every_marker_it_names_exists() -> None:
    problems = [problem for directive in _includes() for problem in include_problems(directive)]
    assert not problems, "\n".join(problems)


def test_every_code_block_is_included_or_an_allowed_command() -> None:
    blocks = [d for page in _pages() for d in _directives(page) if d["name"] in ("code-block", "code", "sourcecode")]
    problems = [problem for block in blocks for problem in block_problems(block)]
    problems += [problem for page in _pages() for problem in _bare_literal_blocks(page)]
    assert not problems, "\n".join(problems)


def test_every_marker_in_an_includable_file_is_paired_and_shown() -> None:
    shown = {(_included_path(d).resolve(), _MARKER.fullmatch(d["options"].get("start-after", "") or "")["name"])
             for d in _includes() if _MARKER.fullmatch(d["options"].get("start-after", "") or "")}
    problems = []
    for pattern in INCLUDABLE:
        for path in sorted(REPO.glob(pattern)):
            if not path.is_file() or path.suffix not in (".py", ".sh", ".json", ".txt", ""):
                continue
            markers = _markers(path)
            for kind, name in markers:
                other = "END" if kind == "START" else "START"
                if (other, name) not in markers:
                    problems.append(f"{path.relative_to(REPO)}: [{kind} {name}] has no [{other} {name}]")
                if kind == "START" and (path.resolve(), name) not in shown:
                    problems.append(f"{path.relative_to(REPO)}: [START {name}] is included by no page")
    assert not problems, "\n".join(problems)


# --- the checks themselves can fail -------------------------------------------------------------
def _fake_include(repo: Path, source: str, start: str | None, end: str | None) -> dict:
    """A ``literalinclude`` of ``source`` in a repository of its own under ``repo``."""
    (repo / "docs" / "examples").mkdir(parents=True)
    (repo / "docs" / "examples" / "probe.py").write_text(source)
    options = {k: v for k, v in (("start-after", start), ("end-before", end)) if v is not None}
    return {"name": "literalinclude", "arg": "/examples/probe.py", "options": options, "body": [], "line": 1,
            "page": repo / "docs" / "index.rst"}


@pytest.mark.parametrize(("source", "start", "end", "expected"), [
    ("# [START howto_x]\nx = 1\n# [END howto_x]\n", "[START howto_x]", "[END howto_x]", None),
    ("x = 1\n# [END howto_x]\n", "[START howto_x]", "[END howto_x]", "[START howto_x] is in"),
    ("# [START howto_x]\nx = 1\n", "[START howto_x]", "[END howto_x]", "[END howto_x] is in"),
    ("# [START howto_x]\n# [START howto_x]\n# [END howto_x]\n", "[START howto_x]", "[END howto_x]", "2 times"),
    ("# [END howto_x]\n# [START howto_x]\n", "[START howto_x]", "[END howto_x]", "comes before"),
    ("# [START howto_x]\n# [END howto_y]\n", "[START howto_x]", "[END howto_y]", "use :start-after:"),
    ("x = '[START howto_x]'\n# [END howto_x]\n", "[START howto_x]", "[END howto_x]", "[START howto_x] is in"),
])
def test_include_problems_finds_a_missing_or_misplaced_marker(tmp_path, source, start, end, expected) -> None:
    problems = include_problems(_fake_include(tmp_path, source, start, end), repo=tmp_path)
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0], problems


def test_include_problems_refuses_a_file_the_tests_do_not_run() -> None:
    directive = {"name": "literalinclude", "arg": "/../pyproject.toml", "options": {}, "body": [], "line": 3,
                 "page": DOCS / "index.rst"}
    [problem] = include_problems(directive)
    assert "pyproject.toml is not a file the tests run" in problem


@pytest.mark.parametrize(("language", "body", "expected"), [
    ("bash", ["make demo", "# a comment", "make test"], None),
    ("bash", ["make demo", "rm -rf /"], "shell line 'rm -rf /'"),
    ("python", ["print(1)"], "must be included"),
    ("json", ["{}"], "must be included"),
    ("text", ["anything"], None),
    ("", ["x"], "names its language"),
])
def test_block_problems_allows_only_listed_commands_and_text(language, body, expected) -> None:
    problems = block_problems({"name": "code-block", "arg": language, "options": {}, "body": body, "line": 7,
                               "page": DOCS / "index.rst"})
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0], problems


def test_the_goodput_example_prints_what_its_page_shows() -> None:
    """``docs/examples/goodput_example.py`` (the goodput page's worked example) prints exactly the
    output the page includes, so the page's numbers are the code's."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, str(DOCS / "examples" / "goodput_example.py")], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == (DOCS / "examples" / "goodput_example.out").read_text()


def _exception_classes(path: Path) -> list[str]:
    """Public classes of ``path`` that derive from an exception (by their bases' names)."""
    import ast

    found, bases_of = [], {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            bases_of[node.name] = [getattr(base, "id", getattr(base, "attr", "")) for base in node.bases]
    for name in bases_of:
        seen, todo = set(), list(bases_of[name])
        while todo:
            base = todo.pop()
            if base in seen:
                continue
            seen.add(base)
            todo += bases_of.get(base, [])
        if not name.startswith("_") and any(b.endswith(("Exception", "Error")) for b in seen | {name}):
            found.append(name)
    return found


def test_troubleshooting_names_every_exception_of_the_provider_and_the_worker() -> None:
    """Each exception the provider raises (``exceptions.py``) and each error the worker exits with
    (``errors.py``) is on the troubleshooting page, so a new one cannot be left out."""
    page = (DOCS / "troubleshooting.rst").read_text()
    provider = _exception_classes(REPO / "airflow_gpu_resilience" / "exceptions.py")
    worker = _exception_classes(REPO / "worker" / "gpu_resilience_worker" / "errors.py")
    assert {"CloudRunGpuFatalError", "CheckpointBucketNotOursError"} <= set(provider)
    assert {"ConfigError", "OutOfSpaceError", "NewerCheckpointError"} <= set(worker)
    missing = [name for name in provider + worker if f"``{name}``" not in page and name != "WorkerError"]
    assert not missing, f"docs/troubleshooting.rst does not name {missing}"


def test_the_emulator_command_lines_parse() -> None:
    """The emulator's command lines the pages show are ones its own parser accepts."""
    import shlex

    from cloud_run_emulator.__main__ import _parser

    lines = [line for line in ALLOWED_SHELL if line.startswith("python -m cloud_run_emulator ")]
    assert lines
    for line in lines:
        args = _parser().parse_args(shlex.split(line)[3:])
        assert args.command == "serve" and args.data_dir


def test_the_sample_demo_report_is_what_the_demo_prints_for_its_json() -> None:
    """``docs/examples/demo-report.txt`` (the "Getting started" page's sample) is the demo's own
    rendering of ``demo-report.json``, a real run's report (``scripts/docs_sample_report.py``)."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("docs_sample_report", REPO / "scripts" / "docs_sample_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rendered = module.render(json.loads(module.SAMPLE_JSON.read_text()))
    assert rendered.startswith("==== airflow-gpu-resilience demo report ====\n")
    assert rendered == module.SAMPLE_TEXT.read_text()



# --- the READMEs ---------------------------------------------------------------------------------
README = REPO / "README.md"
WORKER_README = REPO / "worker" / "README.md"
_FENCE = re.compile(r"^```(?P<language>[\w-]*)\n(?P<body>.*?)^```$", re.S | re.M)
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def _fenced(path: Path) -> list[tuple[str, str]]:
    """The ``(language, body)`` of every fenced code block of a Markdown file."""
    return [(m["language"], m["body"]) for m in _FENCE.finditer(path.read_text())]


def _marked(path: Path, name: str) -> str:
    """The lines between ``[START name]`` and ``[END name]`` of ``path``, as a literalinclude shows them."""
    text = path.read_text()
    return text.split(f"# [START {name}]\n", 1)[1].split(f"# [END {name}]", 1)[0]


def test_the_readmes_are_short() -> None:
    """The README is the way in, not the reference: the reference is the documentation site."""
    assert len(README.read_text().splitlines()) <= 250
    assert len(WORKER_README.read_text().splitlines()) <= 250


def test_every_readme_code_block_is_a_tested_file_or_an_allowed_command() -> None:
    """README.md's Python is the minimal DAG the tests run, its sample report the demo's own
    rendering of a real run; its text blocks are pictures; shell lines are allowed commands."""
    dag = _marked(EXAMPLES_DIR / "dags" / "minimal_dag.py", "howto_minimal_dag")
    report = (EXAMPLES_DIR / "demo-report.txt").read_text()
    problems, seen = [], set()
    for path in (README, WORKER_README):
        for language, body in _fenced(path):
            where = f"{path.relative_to(REPO)}: a {language or 'bare'} block"
            if language in SHELL_LANGUAGES:
                problems += [f"{where}: {line!r} is not in ALLOWED_SHELL" for line in body.splitlines()
                             if line.strip() and not line.startswith("#") and line.strip() not in ALLOWED_SHELL]
            elif language == "python":
                seen.add("dag")
                if body != dag:
                    problems.append(f"{where} differs from docs/examples/dags/minimal_dag.py's howto_minimal_dag")
            elif language == "text" and body.startswith("==== airflow-gpu-resilience demo report"):
                seen.add("report")
                if body != report:
                    problems.append(f"{where} differs from docs/examples/demo-report.txt")
            elif language != "text":
                problems.append(f"{where}: only python (the minimal DAG), shell and text blocks")
    assert not problems, "\n".join(problems)
    assert seen == {"dag", "report"}, "README.md shows the minimal DAG and the sample report"


def test_every_relative_link_of_the_readmes_exists() -> None:
    problems = []
    for path in (README, WORKER_README):
        for match in _LINK.finditer(path.read_text()):
            target = match["target"].split("#", 1)[0]
            if target and "://" not in target and not (path.parent / target).exists():
                problems.append(f"{path.relative_to(REPO)}: {match['target']} does not exist")
    assert not problems, "\n".join(problems)

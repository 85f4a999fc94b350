"""``pip install ./worker`` into a clean virtual environment: no Airflow, no Google package, and
the documentation's own-loop example (``docs/examples/own_loop.py``) runs there; and the
worker's wheel, built from its folder alone, carries the repository's license.

The environment is a real ``python -m venv`` (no system site-packages, no pip of its own: this
environment's pip installs into it with ``--python``, which saves the ``ensurepip`` step). torch
comes from this machine's local wheel store through the ordinary pip configuration, pinned by
``constraints/dev.txt`` (an unpinned torch would resolve to a multi-GB CUDA build), without
bytecode compilation (``--no-compile``: torch has thousands of modules). Cost: about 40 s of CPU
(the venv 1 s, the install ~30 s, mostly unpacking torch; the example 5 s); the timings are printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

from tests.worker.test_readme_example import _root_example

REPO = Path(__file__).resolve().parents[2]

FORBIDDEN_PREFIXES = ("apache-airflow", "google", "grpcio", "protobuf", "airflow-gpu-resilience ")


def _clean_env() -> dict[str, str]:
    """The parent's environment without anything that would leak this checkout into the venv."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith(("CLOUD_RUN_", "CHECKPOINT_"))}


def test_pip_install_worker_in_a_clean_venv_pulls_no_airflow_or_google_and_runs_the_own_loop(tmp_path: Path) -> None:
    env = _clean_env()
    timings = {}
    started = time.monotonic()
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(tmp_path / "venv")
    python = str(tmp_path / "venv" / "bin" / "python")
    timings["venv"] = time.monotonic() - started

    started = time.monotonic()
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-input", "--no-compile",
         "-c", str(REPO / "constraints" / "dev.txt"), str(REPO / "worker")],
        env=env, capture_output=True, text=True, timeout=600)
    timings["pip install ./worker"] = time.monotonic() - started
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    listing = subprocess.run([python, "-c", (
        "import importlib.metadata as m, json\n"
        "print(json.dumps(sorted(d.metadata['Name'] for d in m.distributions())))")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)  # `-c` puts the cwd on sys.path:
    # from the checkout, its editable build's *.egg-info folders would be listed as installed
    names = json.loads(listing.stdout)
    assert "airflow-gpu-resilience-worker" in names and "torch" in names, names
    lowered = [n.lower() + " " for n in names]
    assert not [n for n in lowered if n.startswith(FORBIDDEN_PREFIXES)], names
    assert "numpy" not in lowered and "numpy " not in lowered, names  # only the trainer extra brings numpy

    probe = subprocess.run([python, "-c", (
        "import importlib.util as u, gpu_resilience_worker as g\n"
        "print(g.__file__)\n"
        "assert all(u.find_spec(n) is None for n in ('airflow', 'google', 'numpy', 'airflow_gpu_resilience'))\n")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().startswith(str(tmp_path / "venv")), probe.stdout  # the installed copy, not the checkout

    work = tmp_path / "work"
    work.mkdir()
    (work / "own_loop.py").write_text(_root_example("own-loop", "python"))
    started = time.monotonic()
    run = subprocess.run([python, "own_loop.py"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    timings["own-loop example"] = time.monotonic() - started
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads((work / "checkpoints" / "own-loop" / "metrics.json").read_text())["steps"] == 100
    print("\n".join(f"{what:>24}: {seconds:6.1f} s" for what, seconds in timings.items()), file=sys.stderr)


def test_the_worker_wheel_built_from_its_folder_alone_carries_the_license(tmp_path: Path) -> None:
    """The worker folder copied away from the repository (as a user's image build may take it)
    builds a wheel of both packages that carries the repository's license:
    ``*.dist-info/licenses/LICENSE``, the same text, named in the metadata (``License-File``)."""
    import shutil
    import zipfile

    source = tmp_path / "worker"
    shutil.copytree(REPO / "worker", source, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    out = tmp_path / "wheel"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--no-input", "-w", str(out),
                            str(source)], env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheel = zipfile.ZipFile(next(out.glob("airflow_gpu_resilience_worker-*.whl")))
    # both packages of the distribution: the library and the bundled trainer built on it
    assert {"gpu_resilience_worker/loop.py", "gpu_resilience_trainer/__main__.py"} <= set(wheel.namelist())
    licenses = [n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
    assert len(licenses) == 1, wheel.namelist()
    assert wheel.read(licenses[0]) == (REPO / "LICENSE").read_bytes()
    metadata = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-File: LICENSE" in metadata.splitlines() and "License-Expression: Apache-2.0" in metadata

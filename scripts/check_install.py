"""Install the built wheel as a production deployment would, and check what Airflow sees.

For each target (Airflow 2.11 pinned by ``constraints/airflow2.txt``, the newest Airflow 3 by
``constraints/airflow3.txt``):
a fresh virtual environment under ``build/check-install/``, ``pip install`` of the wheel with the
matching Google provider and no extra, then:

- the emulator's GCS server (``gcp-storage-emulator``) is not installed;
- ``airflow providers list`` shows ``airflow-gpu-resilience`` at the package's version;
- the three example DAGs in ``dags/`` parse with no import errors.

Prints one line per check and a table of the install and check times; exits 1 on any failure.
Usage: ``python scripts/check_install.py [--target airflow2|airflow3] [--keep]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "build" / "check-install"
EXPECTED_DAGS = ["gpu_resilient_training", "gpu_training_sensor", "scheduled_retraining"]
#: Offline google-auth (no metadata-server probe) and a throwaway Airflow home.
OFFLINE = {"NO_GCE_CHECK": "true", "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9",
           "CLOUDSDK_CONFIG": "", "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
#: target -> (pip arguments besides the wheel, description)
TARGETS = {
    "airflow2": (["-c", str(REPO / "constraints" / "airflow2.txt")], "Airflow 2.11 (constraints/airflow2.txt)"),
    "airflow3": (["-c", str(REPO / "constraints" / "airflow3.txt")], "newest Airflow 3 (constraints/airflow3.txt)"),
}
def build_wheel(out: Path) -> Path:
    """Build the wheel of this checkout into ``out``; :return: its path."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(REPO)],
                   check=True)
    [wheel] = out.glob("airflow_gpu_resilience-*.whl")
    return wheel


def check(target: str, wheel: Path, version: str) -> tuple[list[str], float, float]:
    """Install ``wheel`` into a fresh venv for ``target``; :return: (failures, install s, check s)."""
    pip_args, _ = TARGETS[target]
    venv = WORK / target
    shutil.rmtree(venv, ignore_errors=True)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True)
    subprocess.run([py, "-m", "pip", "install", "--quiet", *pip_args, str(wheel)], check=True)
    installed = time.monotonic() - started
    failures: list[str] = []

    def report(ok: bool, what: str) -> None:
        print(f"[{target}] {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory(prefix="agr-check-home-") as home:
        env = {**os.environ, **OFFLINE, "AIRFLOW_HOME": home, "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags")}
        env.pop("PYTHONPATH", None)
        airflow_version = subprocess.run([py, "-c", "import airflow; print(airflow.__version__)"], env=env,
                                         capture_output=True, text=True, check=True).stdout.strip()
        print(f"[{target}] Airflow {airflow_version}", flush=True)
        shown = subprocess.run([py, "-m", "pip", "show", "gcp-storage-emulator"], capture_output=True, text=True)
        report(shown.returncode != 0, "gcp-storage-emulator is not installed")
        listed = subprocess.run([py, "-m", "airflow", "providers", "list", "-o", "json"], env=env,
                                capture_output=True, text=True, timeout=300)
        try:
            providers = {p["package_name"]: p["version"]
                         for p in json.loads(listed.stdout[listed.stdout.index("["):])}
        except ValueError:
            providers = {}
            print(listed.stdout[-2000:], listed.stderr[-2000:], sep="\n")
        report(providers.get("airflow-gpu-resilience") == version,
               f"airflow providers list shows airflow-gpu-resilience {version}")
        # What Airflow itself reports: the CLI parses the DAGs folder (on its sys.path, as the
        # DAG processor has it) and stores what it found (``dags reserialize``; Airflow 3's
        # ``list-import-errors`` only reads what a parse stored), then lists import errors and DAGs.
        airflow = str(venv / "bin" / "airflow")
        subprocess.run([airflow, "db", "migrate"], env=env, cwd=home, check=True, capture_output=True, timeout=600)
        subprocess.run([airflow, "dags", "reserialize"], env=env, cwd=home, check=True, capture_output=True,
                       timeout=600)
        errors = _cli_json([airflow, "dags", "list-import-errors", "-o", "json"], env, home)
        report(errors == [], f"dags/ parses with no import errors {errors or ''}")
        files = _cli_json([airflow, "dags", "report", "-o", "json"], env, home) or []
        dags = sorted(d for f in files for d in (f["dags"] if isinstance(f["dags"], list) else [f["dags"]]))
        report(dags == EXPECTED_DAGS, f"dags/ holds {EXPECTED_DAGS} (found {dags})")
    return failures, installed, time.monotonic() - started - installed


def _cli_json(command: list[str], env: dict[str, str], cwd: str):
    """Run an ``airflow ... -o json`` command; :return: its JSON (the last line), or ``None``."""
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(done.stdout[-2000:], done.stderr[-3000:], sep="\n")
        return None


def main(argv: list[str] | None = None) -> int:
    """Run the checks; :return: the exit status (0 when every check passed)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), action="append",
                        help="check only this target (repeatable; default: all)")
    parser.add_argument("--keep", action="store_true", help="keep the virtual environments under build/")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from airflow_gpu_resilience import __version__

    WORK.mkdir(parents=True, exist_ok=True)
    wheel = build_wheel(WORK / "dist")
    print(f"wheel: {wheel.name}", flush=True)
    rows, failed = [], False
    for target in args.target or list(TARGETS):
        failures, installed, checked = check(target, wheel, __version__)
        failed = failed or bool(failures)
        rows.append((target, TARGETS[target][1], installed, checked, "ok" if not failures else "FAILED"))
        if not args.keep:
            shutil.rmtree(WORK / target, ignore_errors=True)
    print(f"\n{'target':<10} {'environment':<42} {'install s':>10} {'checks s':>9}  result")
    for target, what, installed, checked, result in rows:
        print(f"{target:<10} {what:<42} {installed:>10.0f} {checked:>9.0f}  {result}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

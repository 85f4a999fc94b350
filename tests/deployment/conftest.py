"""One real Airflow deployment for the deployment tests (``scripts/airflow_stack.py``), shared by
the deployment scenarios, and the session's timing table.

The stack is started once (PostgreSQL, the emulators, ``db migrate``, API server, scheduler, DAG
processor, triggerer: 30 to 90 s on 2 cores) and stopped once the last deployment test has run,
also when a test fails or the run is interrupted. Its state and logs, the timings (``timings.json``) and the
browser's screenshot go to ``test-output/deployment/<time>/`` in the repository (kept, so a
failure can be read; ``rm -rf test-output`` clears them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config, items) -> None:
    """The deployment tests are part of ``make test``; ``DEPLOYMENT_TESTS=0`` skips them (about 9
    minutes on 2 cores; ``make test-deployment`` runs only them)."""
    if os.environ.get("DEPLOYMENT_TESTS", "1") != "0":
        return
    skip = pytest.mark.skip(reason="deployment tests skipped: DEPLOYMENT_TESTS=0")
    here = Path(__file__).resolve().parent
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(here):
            item.add_marker(skip)


def _load_stack_module():
    spec = importlib.util.spec_from_file_location("agr_airflow_stack", REPO / "scripts" / "airflow_stack.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


airflow_stack = _load_stack_module()
import stack_sweep  # noqa: E402  (scripts/, on the path once airflow_stack is loaded)

#: The deployment tests' waiting helpers (:mod:`stack_sweep`, shared with the watch-scale benchmark).
wait_for, unpause_when_parsed = stack_sweep.wait_for, stack_sweep.unpause_when_parsed

#: Settings of every Airflow process in the test deployment (what an operator of a deployment
#: would put into ``airflow.cfg``): one retry after 2 s, so that a killed task process is retried
#: at once; fast heartbeats and a 10 s triggerer health threshold, so that triggers of a killed
#: triggerer are handed to the restarted one within seconds rather than the default 30 s. Two DAG
#: bundles: the example DAGs (``dags/``, the DAGs folder) and the tests' own
#: (``tests/deployment/dags/``).
TEST_AIRFLOW_CONFIG = {
    "AIRFLOW__CORE__DEFAULT_TASK_RETRIES": "1",
    "AIRFLOW__CORE__DEFAULT_TASK_RETRY_DELAY": "2",
    **airflow_stack.FAST_HEARTBEATS,
    "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "10",
    "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
    "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps([
        {"name": "dags-folder", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle", "kwargs": {}},
        {"name": "deployment-tests", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
         "kwargs": {"path": str(REPO / "tests" / "deployment" / "dags")}},
    ]),
}

_TIMINGS: list[dict] = []


def record_timing(scenario: str, **values) -> None:
    """Add one row to the session's timing table (printed at the end, and ``timings.json``)."""
    _TIMINGS.append({"scenario": scenario, **values})


@pytest.fixture(scope="session")
def output_dir() -> Path:
    """``test-output/deployment/<UTC time>/``: the stack's logs, timings and screenshots."""
    path = REPO / "test-output" / "deployment" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="package")
def stack(output_dir: Path):
    """The running deployment (an :class:`AirflowStack`), started once for the deployment tests
    and stopped when the last of them has run (not at the end of the whole session: its five
    Airflow processes and PostgreSQL would otherwise take CPU from every later test)."""
    if shutil.which("initdb") is None and not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        pytest.fail("PostgreSQL is not installed: `apt-get install -y postgresql` (scripts/system_packages.sh does it as root)")
    begin = time.monotonic()
    with airflow_stack.AirflowStack(output_dir / "stack", grace_seconds=3.0,
                                    airflow_config=TEST_AIRFLOW_CONFIG) as running:
        record_timing("stack start-up", seconds=round(time.monotonic() - begin, 1), **running.timings)
        yield running
    (output_dir / "timings.json").write_text(json.dumps(_TIMINGS, indent=2))


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the deployment scenarios' timings as a table."""
    if not _TIMINGS:
        return
    terminalreporter.section("deployment scenario timings (seconds)")
    keys = []
    for row in _TIMINGS:
        keys += [k for k in row if k not in keys and k != "scenario"]
    width = max(len(row["scenario"]) for row in _TIMINGS)
    terminalreporter.write_line(f"{'scenario':<{width}}  " + "  ".join(f"{k:>16}" for k in keys))
    for row in _TIMINGS:
        cells = "  ".join(f"{str(row.get(k, '')):>16}" for k in keys)
        terminalreporter.write_line(f"{row['scenario']:<{width}}  {cells}")

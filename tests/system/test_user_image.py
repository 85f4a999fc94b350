"""The user-image example: its Dockerfile, its image table entry, and the example DAG running it.

The DAG ``gpu_resilient_training`` runs unchanged but for its ``image`` param, set to the
example's image; the emulator combines the bundled worker's image table with the example's
(``serve --images A --images B``), so the same DAG runs either image.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from tests.system.test_dags import BUCKET, REPO, _load_demo

# serial (scripts/run_tests.sh runs it alone): a real preemption: the script must exit 143 within the grace period.
pytestmark = pytest.mark.serial

EXAMPLE = REPO / "examples" / "user-image"
USER_IMAGE = "us-central1-docker.pkg.dev/local-project/ml/my-own-trainer:latest"
TABLES = [REPO / "worker" / "emulator-image.json", EXAMPLE / "emulator-image.json"]


def test_the_dockerfile_installs_the_library_and_runs_the_script_the_table_runs() -> None:
    """Exec-form ENTRYPOINT (the script is PID 1), the library from ``worker/``, every COPY source
    present in the build context (the repository root), and the same script as the image table."""
    lines = [line.strip() for line in (EXAMPLE / "Dockerfile").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    [entrypoint] = [json.loads(line.split(None, 1)[1]) for line in lines if line.startswith("ENTRYPOINT")]
    assert isinstance(entrypoint, list) and entrypoint[0] == "python"
    copies = [line.split()[1:] for line in lines if line.startswith("COPY")]
    assert all((REPO / source).exists() for source, _ in copies), copies
    assert ["worker", "/tmp/gpu-resilience-worker"] in copies
    assert any(line.startswith("RUN pip install") and "/tmp/gpu-resilience-worker" in line for line in lines)
    assert ["examples/user-image/train.py", entrypoint[1]] in copies
    from cloud_run_emulator.images import ImageTable

    entry = ImageTable.load(TABLES).resolve(USER_IMAGE)
    assert entry is not None and entry.entrypoint[1:] == ("train.py",) and entry.cwd == EXAMPLE
    assert ImageTable.load(TABLES).resolve(USER_IMAGE.replace("my-own-trainer", "airflow-gpu-resilience-worker"))


@pytest.mark.e2e
def test_example_dag_runs_the_user_image_through_one_preemption_and_resumes(tmp_path: Path) -> None:
    """Cost: 55-75 s on 2 busy cores (one ``airflow dags test``, two attempts of the script)."""
    from cloud_run_emulator.process import EmulatorProcess

    demo = _load_demo()
    steps = 60
    conf = {"image": USER_IMAGE, "steps": steps, "checkpoint_every": 10, "step_delay_seconds": 0.05,
            "poll_interval_seconds": 1.0}
    with EmulatorProcess(tmp_path / "emulator", images_file=TABLES) as emulator:
        preempter = demo.Preempter(emulator, 1, steps)
        preempter.start()
        try:
            log_path = tmp_path / "run.log"
            rc = demo.run_dag(demo.airflow_env(tmp_path, emulator), conf, log_path)
        finally:
            preempter.stop.set()
            preempter.join(timeout=30)
        log = log_path.read_text()
        assert rc == 0, log[-6000:]
        [task_dir] = (emulator.bucket_dir(BUCKET) / "gpu-resilient-training").glob("*/task-0")
        metrics = json.loads((task_dir / "metrics.json").read_text())
        attempt_logs = sorted((tmp_path / "emulator").rglob("*.log"))

    assert preempter.error is None and len(preempter.records) == 1, preempter.records
    [preemption] = preempter.records
    assert preemption["exit_code"] == 143, preemption  # the script flushed and exited 143 in the grace
    # the user's script ran (its metrics: synthetic test set of 512) and resumed where it stopped
    assert metrics["steps"] == steps and metrics["test_samples"] == 512 and "model_sha256" in metrics
    first, second = metrics["attempts"]
    assert first["resumed_from_step"] == 0 and second["resumed_from_step"] >= preemption["injected_at_step"] > 0
    # the execute operator logs the preempted attempt and the one that resumed and succeeded; the
    # report (built from its summary and metrics.json) returns the preemption and two attempts
    assert re.search(r"task 0 attempt 0: PREEMPTED \(exit code 143\)", log), log[-6000:]
    assert re.search(r"task 0 attempt 1: SUCCEEDED \(exit code 0", log), log[-6000:]
    [returned] = [ast.literal_eval(m) for m in re.findall(r"Returned value was: (\{'tasks': .*\}) \[", log)]
    assert [p["exit_code"] for p in returned["preemptions"]] == [143]
    assert returned["tasks"][0]["attempts"] == 2 and returned["tasks"][0]["steps"] == steps
    resumed = [line for p in attempt_logs for line in p.read_text(errors="replace").splitlines()
               if '"resuming from step' in line]
    assert resumed, [str(p) for p in attempt_logs]

"""End to end: the demo with one preemption that loses work, and the log option on.

One run of ``scripts/demo.py`` (``airflow dags test`` against the Cloud Run and GCS emulators, the
real worker) with ``--preemption-save never`` (the preempted attempt does not checkpoint at its
SIGTERM, so the next one computes the steps since the last checkpoint again) and
``--log-container-output`` (the execute operator reads the container logs through
``google-cloud-logging`` from the emulator's ``entries:list``). Several assertions share it:
the goodput account against the emulator's own attempt times, wasted progress against the
worker's log lines, and the task log's copy of those lines. Cost: one demo run, about 60-90 s
on two idle cores.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_gpu_resilience.goodput import BUCKETS

REPO = Path(__file__).resolve().parents[2]

# serial (scripts/run_tests.sh runs it alone): real preemptions of the demo: every attempt must log its preemption within the grace period.
pytestmark = [pytest.mark.e2e, pytest.mark.serial]


STOPPED = re.compile(r"attempt 0 WARNING: SIGTERM received; stopping at step (\d+)")
RESUMED = re.compile(r"attempt 1 INFO: resuming from step (\d+)")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[dict, str]:
    """One demo run whose preemption lost work. The preemption lands where the worker happens to
    be (it waits for progress.json, written once a second); a SIGTERM right after a checkpoint
    loses nothing, which is correct but leaves nothing to account, so such a run is repeated (at
    most three runs in all)."""
    for run in range(3):
        workdir = tmp_path_factory.mktemp("goodput") / "demo"
        report_path = workdir.parent / "report.json"
        result = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "demo.py"), "--steps", "80", "--checkpoint-every", "20",
             "--step-delay", "0.03", "--hidden", "256", "--preemptions", "1", "--preemption-save", "never",
             "--log-container-output", "--no-verify", "--workdir", str(workdir), "--report", str(report_path)],
            capture_output=True, text=True, timeout=600, cwd=REPO,
        )
        log = workdir / "airflow-dags-test.log"
        text = log.read_text() if log.exists() else ""
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:] + text[-8000:]
        stopped, resumed = STOPPED.search(text), RESUMED.search(text)
        if stopped and resumed and int(stopped.group(1)) == int(resumed.group(1)) and run < 2:
            continue  # stopped right at a checkpoint: nothing was lost, so nothing to account
        return json.loads(report_path.read_text()), text
    raise AssertionError("unreachable")


def test_buckets_add_up_to_the_attempts_wall_time_as_the_emulator_recorded_it(demo) -> None:
    report, _ = demo
    goodput, platform = report["goodput"], report["goodput"]["platform"]
    [account] = goodput["tasks"]
    assert platform["attempts"] == len(account["attempts"]) == 2
    assert sum(account[b] for b in BUCKETS) == pytest.approx(account["span_seconds"], rel=1e-9)
    assert account["span_seconds"] == pytest.approx(platform["span_seconds"], rel=0.01)
    assert account["attempt_seconds"] == pytest.approx(platform["attempt_seconds"], rel=0.01)
    assert account["productive"] > 0 and account["startup"] > 0
    assert all(b in goodput["table"] for b in BUCKETS)


def test_wasted_progress_is_the_steps_recomputed_times_the_measured_step_time(demo) -> None:
    report, log = demo
    [account] = report["goodput"]["tasks"]
    first, second = account["attempts"]
    # independently of the worker's events file: its own log lines, copied into the task log
    stopped = int(STOPPED.search(log).group(1))
    resumed = int(RESUMED.search(log).group(1))
    assert stopped > resumed, "with --preemption-save never the resume is behind the stop"
    assert (first["steps_recomputed"], second["steps_recomputed"]) == (0, stopped - resumed)
    assert second["wasted"] == pytest.approx((stopped - resumed) * second["step_seconds"])
    # the step time is the worker's measurement (each step includes the demo's --step-delay 0.03),
    # and it is not the whole attempt: the recomputed steps fit in the attempt's training time
    assert second["step_seconds"] >= 0.03
    assert second["wasted"] < second["productive"] + second["wasted"] <= second["wall_seconds"]
    assert account["wasted"] == pytest.approx(second["wasted"]) and account["wasted"] > 0


def test_the_task_log_shows_every_attempts_preemption_and_resume_lines_once(demo) -> None:
    report, log = demo
    lines = [line for line in log.splitlines() if "Container log: " in line]
    preemption = [line for line in lines if "attempt 0 WARNING: SIGTERM received; stopping at step" in line]
    platform = [line for line in lines if "attempt 0 WARNING: [platform]" in line and "maintenance" in line]
    resume = [line for line in lines if "attempt 1 INFO: resuming from step" in line]
    done = [line for line in lines if "attempt 1 INFO: training complete" in line]
    assert (len(preemption), len(platform), len(resume), len(done)) == (1, 1, 1, 1), "\n".join(lines)
    assert report["logging_requests"] >= 1

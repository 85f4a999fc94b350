"""The goodput account bills every attempt Cloud Run ran, against the emulator's own record.

Twenty maintenance preemptions, each in an attempt's start-up: before the bundled worker's restore,
so before it writes its goodput events file. Cloud Run's API keeps the times of a task's latest
attempt only, so these attempts have no times of their own; the account places them between their
neighbours and bills them. With ``max_retries`` 10 the first execution runs out of retries after
eleven preemptions and the execute operator re-runs it; the second execution's tenth attempt
trains to the end. The account's GPU-seconds must match the emulator's record of its attempts
(``/_emulator/attempts``: each attempt's process start to its end) within 1 %. Its cost: 21 worker
start-ups.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from airflow_gpu_resilience.goodput import BUCKETS
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator
from tests.provider.conftest import BUCKET, REGION
from tests.provider.operators.test_progress_reruns import (  # noqa: F401 - worker_emulator is a fixture
    WORKER_IMAGE, _TI, deploy, executions, worker_emulator,
)

# serial (scripts/run_tests.sh runs it alone): each preemption must land in a worker's start-up.
pytestmark = [pytest.mark.usefixtures("airflow_db"), pytest.mark.serial]

PREEMPTIONS = 20
#: Seconds between seeing an attempt start and preempting it: the worker has its SIGTERM handler by
#: then (it stops after loading torch, with no events file), and is still far from its restore.
IN_STARTUP = 0.2


def preempt_every_startup(emulator, job_name: str, count: int, answers: list, stop: threading.Event,
                          ready: Callable[[str], bool] | None = None) -> threading.Thread:
    """In the background: preempt task 0's attempts one after another, each :data:`IN_STARTUP`
    seconds after it was seen running, ``count`` times, in whichever execution is the newest.

    :param ready: instead of waiting :data:`IN_STARTUP`, preempt a running attempt once
        ``ready(its execution's name)`` is true (asked every 0.05 s while it runs)."""
    hook = CloudRunGpuHook()

    def newest_attempt() -> tuple[str, int] | None:
        found = executions(job_name)
        if not found or found[-1].completion_time:
            return None
        tasks = hook.list_tasks(execution=found[-1].name)
        running = tasks and tasks[0].start_time and hook.get_execution(execution=found[-1].name).running_count
        return (found[-1].name, int(tasks[0].retried)) if running else None

    def run() -> None:
        done: set[tuple[str, int]] = set()
        while len(answers) < count and not stop.is_set():
            current = newest_attempt()
            if current is None or current in done or (ready is not None and not ready(current[0])):
                time.sleep(0.05)
                continue
            if ready is None:
                time.sleep(IN_STARTUP)
            try:
                answer = emulator.preempt(current[0], task_index=0)
            except RuntimeError:  # it ended meanwhile: look again
                continue
            done.add((current[0], int(answer["attempt"])))
            answers.append(answer)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_attempts_stopped_before_their_events_file_are_billed_as_the_emulator_recorded(worker_emulator, job_name):
    deploy(job_name, WORKER_IMAGE, ["train", "--steps", "30", "--step-delay", "0.03", "--checkpoint-every", "10"],
           max_retries=10)
    answers: list[dict] = []
    stop = threading.Event()
    preempter = preempt_every_startup(worker_emulator, job_name, PREEMPTIONS, answers, stop)
    op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION, deferrable=False,
                                       poll_interval=0.2, checkpoint_bucket=BUCKET, max_preemption_reruns=2)
    try:
        summary = op.execute({"ti": _TI()})
    finally:
        stop.set()
        preempter.join(timeout=30)
    assert len(answers) == PREEMPTIONS, answers
    found = executions(job_name)
    recorded = [a for e in found for a in worker_emulator.attempts(e.name)]
    assert len(found) == 2 and [a["stopReason"] for a in recorded] == ["preempted"] * PREEMPTIONS + [None]
    [account] = summary["goodput"]["tasks"]
    # Billed time comes from Cloud Run's attempt times: every attempt, within 1 % of the record
    assert account["gpu_seconds"] == pytest.approx(sum(a["seconds"] for a in recorded), rel=0.01)
    rows = account["attempts"]
    # Cloud Run's API times each execution's last attempt (the eleventh, the twenty-first); the
    # worker wrote no events in the others: they are placed between their neighbours
    timed = ["inferred"] * 10 + ["platform"]
    assert [r["times_from"] for r in rows] == timed + timed[1:], rows
    assert (account["unknown_attempts"], account["inferred_attempts"]) == (0, PREEMPTIONS - 1)
    assert not any(r["reached_first_step"] for r in rows[:-1]) and rows[-1]["productive"] > 0
    assert sum(account[b] for b in BUCKETS) == pytest.approx(account["span_seconds"])
    assert f"({PREEMPTIONS - 1} attempt(s) without worker events)" in summary["goodput"]["headline"]

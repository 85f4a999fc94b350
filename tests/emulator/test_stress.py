"""Stress: 200 short tasks at parallelism 8 finish with exact counters while the API stays fast.

A correctness test, not a benchmark (``benchmarks/bench_emulator.py`` measures): it asserts the
final counters, the retry of the four tasks whose first attempt fails, that no poll ever sees
more than 8 tasks running, and that every ``get_execution`` answered within 1 s.
"""

from __future__ import annotations

import time

from google.cloud import run_v2

import pytest

from .conftest import PARENT, make_job

# serial (scripts/run_tests.sh runs it alone): a latency bound (every get_execution under 1 s while 200 tasks run).
pytestmark = pytest.mark.serial

TASKS, PARALLELISM = 200, 8
FLAKY = {i for i in range(TASKS) if i % 50 == 7}  # exit 1 on attempt 0 (see SHORT_SCRIPT)


def poll_until_done(executions, name: str, timeout: float = 60.0) -> tuple:
    """Poll ``get_execution`` back to back; return ``(final execution, latencies, samples)``."""
    latencies, samples = [], []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = time.perf_counter()
        execution = executions.get_execution(name=name)
        latencies.append(time.perf_counter() - started)
        samples.append((execution.running_count, execution.succeeded_count))
        if execution.completion_time:
            return execution, latencies, samples
        time.sleep(0.01)
    raise AssertionError(f"{name} did not finish within {timeout} s")


def test_200_tasks_parallelism_8_exact_counters_and_responsive_api(jobs, executions, tasks, emulator, job_id):
    spec = make_job("local/short", task_count=TASKS, parallelism=PARALLELISM, max_retries=1)
    job = jobs.create_job(parent=PARENT, job=spec, job_id=job_id).result(timeout=10)
    op = jobs.run_job(name=job.name)
    execution, latencies, samples = poll_until_done(executions, op.metadata.name)

    assert op.result(timeout=10).succeeded_count == TASKS
    assert (execution.succeeded_count, execution.failed_count, execution.cancelled_count) == (TASKS, 0, 0)
    assert execution.running_count == 0 and execution.retried_count == len(FLAKY)
    assert max(running for running, _ in samples) <= PARALLELISM
    done = [succeeded for _, succeeded in samples]
    assert done == sorted(done) and len(samples) > 5  # counters never go back; polled while running
    assert max(latencies) < 1.0, f"slowest get_execution took {max(latencies):.3f} s"

    listed = list(tasks.list_tasks(request=run_v2.ListTasksRequest(parent=execution.name, page_size=50)))
    assert [t.index for t in listed] == list(range(TASKS))
    assert {t.index for t in listed if t.retried} == FLAKY and all(t.retried <= 1 for t in listed)
    assert all(t.last_attempt_result.exit_code == 0 and t.completion_time for t in listed)
    logs = sorted(p.name for p in (emulator.data_dir / "logs" / execution.name.rsplit("/", 1)[-1]).iterdir())
    assert len(logs) == TASKS + len(FLAKY) and "task7-attempt1.log" in logs

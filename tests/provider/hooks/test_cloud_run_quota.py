"""CloudRunGpuHook under Cloud Run's read quota: a read answered 429 RESOURCE_EXHAUSTED is retried
with backoff within the call's deadline, and waiting for an execution goes on until it finishes.

An emulator of this module's own, with a read quota of 4 per 3 s window (Cloud Run's is per
minute; the short window only keeps the test short), on both transports (``gcp_conn``).
"""

from __future__ import annotations


import pytest

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.job_spec import GpuJobSpec
from airflow_gpu_resilience.outcome import ExecutionState, execution_state
from tests.provider.conftest import BUCKET, PROJECT, REGION, STUB_IMAGE, stub_emulator

READS, WINDOW_SECONDS = 4, 3.0


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """Overrides the session's emulator (which ``gcp_conn`` points at) with a read quota."""
    with stub_emulator(tmp_path_factory.mktemp("quota-emulator"), read_quota_per_minute=READS, write_quota_per_minute=None,
                       quota_window_seconds=WINDOW_SECONDS) as emu:
        yield emu


def test_reads_over_the_quota_are_retried_and_the_wait_goes_on(gcp_conn, emulator, job_name):
    hook = CloudRunGpuHook(gcp_conn_id=gcp_conn)
    hook.create_job(job_name=job_name, job=GpuJobSpec(name=job_name, image=STUB_IMAGE, checkpoint_bucket=BUCKET),
                    region=REGION)
    _, execution = hook.run_job(job_name=job_name, region=REGION,
                                overrides={"container_overrides": [{"args": ["sleep", "2"]}]})
    emulator.requests(reset=True)
    for _ in range(READS + 1):  # the window's reads and one more: its 429 is retried after a backoff
        assert hook.get_execution(execution=execution).name == execution
    polls = []
    final = hook.wait_for_execution(execution, poll_interval=0.05, timeout=120,
                                    on_poll=lambda _execution, tasks: polls.append(len(tasks)))
    assert execution_state(final) is ExecutionState.SUCCEEDED and polls[-1] == 1
    counts = emulator.requests(project=PROJECT, region=REGION)["methods"]
    assert counts["GetExecution"]["quotaExceeded"] >= 1
    # every poll the hook completed was admitted: one GetExecution and one ListTasks each
    assert counts["ListTasks"]["requests"] - counts["ListTasks"]["quotaExceeded"] == len(polls)
    assert counts["GetExecution"]["requests"] - counts["GetExecution"]["quotaExceeded"] == READS + 1 + len(polls)

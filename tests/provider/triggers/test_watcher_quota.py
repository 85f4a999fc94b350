"""The shared watcher under Cloud Run's read quota: a 429 RESOURCE_EXHAUSTED delays its polls and
never ends a trigger's wait.

An emulator of this module's own with a read quota of 4 per 10 s window (Cloud Run's is per
minute; the short window only keeps the test short), on both transports (``gcp_conn``).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from cloud_run_emulator.process import post_json
from airflow_gpu_resilience.triggers.cloud_run import CloudRunGpuExecutionTrigger
from tests.provider.conftest import PROJECT, REGION, stub_emulator
from tests.provider.triggers.test_cloud_run import start

READS, WINDOW_SECONDS = 4, 10.0


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """Overrides the session's emulator (which ``gcp_conn`` points at) with a read quota."""
    with stub_emulator(tmp_path_factory.mktemp("watcher-quota-emulator"), read_quota_per_minute=READS, write_quota_per_minute=None,
                       quota_window_seconds=WINDOW_SECONDS) as emu:
        yield emu


def wait_for_an_empty_window(emulator) -> None:
    """Wait until no read of the test region is left in the quota's window (the jobs' creation read
    their operations)."""
    deadline = time.monotonic() + 3 * WINDOW_SECONDS
    while time.monotonic() < deadline:
        usage = post_json(emulator.endpoint + "/_emulator/quota", None, method="GET")["usage"]
        if usage.get(f"projects/{PROJECT}/locations/{REGION}", {}).get("read", 0) == 0:
            return
        time.sleep(0.2)
    raise TimeoutError("the read quota's window did not empty")


def test_reads_over_the_quota_delay_the_watch_and_never_end_it(gcp_conn, emulator, job_name):
    from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook

    hook = CloudRunGpuHook(gcp_conn_id=gcp_conn)
    executions = [start(hook, f"{job_name}-{i}", ["sleep", "1"]) for i in range(3)]
    wait_for_an_empty_window(emulator)
    emulator.requests(reset=True)
    for _ in range(READS):  # the window's reads, used up at once: the watcher's first listing gets a 429
        hook.get_execution(execution=executions[0])
    triggers = [CloudRunGpuExecutionTrigger(execution=name, poll_interval=1.0, carry={"i": i})
                for i, name in enumerate(executions)]

    async def run_all():
        return await asyncio.wait_for(asyncio.gather(*(anext(t.run()) for t in triggers)), timeout=180)

    events = [event.payload for event in asyncio.run(run_all())]
    assert [(e["status"], e["execution"], e["carry"]) for e in events] == [
        ("succeeded", name, {"i": i}) for i, name in enumerate(executions)]
    counts = emulator.requests(project=PROJECT, region=REGION)["methods"]
    assert counts["ListExecutions"]["quotaExceeded"] >= 1
    assert counts["GetExecution"]["requests"] == READS  # the watcher itself read no execution alone

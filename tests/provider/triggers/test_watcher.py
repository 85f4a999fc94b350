"""The shared execution watcher: many triggers in one event loop, counted by the emulator.

Every test runs real triggers (:class:`CloudRunGpuExecutionTrigger`) in one event loop against
the emulator, on both transports, and reads the emulator's per-method request counters.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from airflow_gpu_resilience.triggers import execution_watcher
from airflow_gpu_resilience.triggers.cloud_run import CloudRunGpuExecutionTrigger
from tests.provider.conftest import PROJECT, REGION, wait_until_running
from tests.provider.triggers.test_cloud_run import start


@pytest.fixture
def hook(gcp_conn):
    from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook

    return CloudRunGpuHook(gcp_conn_id=gcp_conn)


def reads(emulator) -> dict[str, int]:
    """Requests per read method in the test region since the counters were last reset."""
    methods = emulator.requests(project=PROJECT, region=REGION)["methods"]
    return {name: counts["requests"] for name, counts in methods.items()}


async def running_watcher(timeout: float = 30.0) -> execution_watcher.ExecutionWatcher:
    """The event loop's one watcher, once it exists."""
    async def one():
        while len(execution_watcher.watchers()) != 1:
            await asyncio.sleep(0.01)
        return next(iter(execution_watcher.watchers().values()))

    return await asyncio.wait_for(one(), timeout)


async def first_events(triggers) -> tuple[list[dict], execution_watcher.ExecutionWatcher]:
    """Run ``triggers`` in this loop to their first event; also return the watcher they shared."""
    tasks = [asyncio.ensure_future(anext(trigger.run())) for trigger in triggers]
    watcher = await running_watcher()
    events = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    await asyncio.wait_for(watcher.task, timeout=10)  # it stops with its last trigger
    return [event.payload for event in events], watcher


def test_n_triggers_share_one_listing_per_poll(hook, job_name, emulator):
    executions = [start(hook, f"{job_name}-{i}", ["sleep", str(1 + i % 3)]) for i in range(6)]
    emulator.requests(reset=True)
    triggers = [CloudRunGpuExecutionTrigger(execution=name, poll_interval=1.0) for name in executions]
    events, watcher = asyncio.run(first_events(triggers))
    assert [(e["status"], e["execution"]) for e in events] == [("succeeded", name) for name in executions]
    assert all([(a["attempt"], a["exit_code"]) for a in e["attempts"]] == [(0, 0)] for e in events)
    counted = reads(emulator)
    # one ListExecutions per poll for all six triggers; no per-trigger GetExecution; each
    # execution's tasks read at most once (when it finished), or the region's at once
    assert counted.get("ListExecutions") == watcher.polls
    assert counted.get("GetExecution", 0) == 0
    assert 1 <= counted.get("ListTasks", 0) <= len(executions)


def test_duplicate_triggers_share_one_watch(hook, job_name, emulator):
    execution = start(hook, job_name, ["sleep-first", "60", "3"], max_retries=1)
    other = start(hook, f"{job_name}-b", ["exit", "3"])
    wait_until_running(hook, execution)

    async def scenario():
        triggers = [CloudRunGpuExecutionTrigger(execution=execution, poll_interval=1.0, carry={"copy": i})
                    for i in range(3)] + [CloudRunGpuExecutionTrigger(execution=other, poll_interval=1.0)]
        tasks = [asyncio.ensure_future(anext(trigger.run())) for trigger in triggers]
        watcher = await running_watcher()
        while watcher.polls < 1:
            await asyncio.sleep(0.01)
        shared = watcher.watched[execution]
        assert (shared.subscribers, len(watcher.watched)) == (3, 2)
        await asyncio.to_thread(emulator.preempt, execution, 0, 0.5)
        events = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        await asyncio.wait_for(watcher.task, timeout=10)
        return [event.payload for event in events]

    emulator.requests(reset=True)
    *copies, failed = asyncio.run(scenario())
    assert [event["carry"] for event in copies] == [{"copy": 0}, {"copy": 1}, {"copy": 2}]
    assert all({**event, "carry": None} == {**copies[0], "carry": None} for event in copies)
    assert copies[0]["status"] == "succeeded"
    assert [(a["attempt"], a["term_signal"], a["exit_code"]) for a in copies[0]["attempts"]] == [(0, 15, None),
                                                                                               (1, None, 0)]
    assert failed["status"] == "failed" and failed["attempts"][-1]["exit_code"] == 3
    assert reads(emulator).get("GetExecution", 0) == 0


def test_a_cancelled_trigger_unsubscribes_and_the_watcher_stops(hook, job_name, emulator):
    execution = start(hook, job_name, ["sleep", "60"])

    async def scenario():
        trigger = CloudRunGpuExecutionTrigger(execution=execution, poll_interval=1.0, cancel_on_kill=False)
        waiting = asyncio.ensure_future(anext(trigger.run()))
        watcher = await running_watcher()
        while watcher.polls < 2:
            await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(watcher.task, timeout=10)
        return watcher, execution_watcher.watchers()

    emulator.requests(reset=True)
    try:
        watcher, left = asyncio.run(scenario())
        assert (watcher.watched, left, watcher.task.done()) == ({}, {}, True)
        assert reads(emulator)["ListExecutions"] == watcher.polls
    finally:
        hook.cancel_execution(execution=execution, wait=True)


def test_importing_the_trigger_module_imports_no_google_client():
    """The triggerer imports trigger modules on its event loop: the Google clients (most of the
    import time) load later, in a thread."""
    code = ("import sys, airflow.triggers.base; before = set(sys.modules); "
            "import airflow_gpu_resilience.triggers.cloud_run; "
            "print(sorted(m for m in set(sys.modules) - before if m.startswith(('google', 'grpc', 'proto'))"
            " or m.startswith('airflow_gpu_resilience.hooks')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


#: Run in a fresh interpreter: a trigger's first run imports the watcher (the Google clients)
#: through the trigger module; a full collection's count, whether an object made before the
#: import is still scanned by the collector, and the collector's state after a second import
#: made with the collector disabled.
FIRST_RUN_IMPORT = """
import asyncio, gc, json, airflow.triggers.base
from airflow_gpu_resilience.triggers import cloud_run
full = []
gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2 and full.append(info))
made_before = [object()]
asyncio.run(cloud_run._import(cloud_run._WATCHER_MODULE))
scanned = any(o is made_before for o in gc.get_objects())
enabled_after = gc.isenabled()
gc.disable()
asyncio.run(cloud_run._import("wave"))
print(json.dumps({"full": len(full), "scanned": scanned, "enabled": [enabled_after, gc.isenabled()]}))
"""


def test_the_first_trigger_imports_the_google_clients_without_a_full_collection():
    """The Google clients' import at a trigger's first run (in a thread) starts no collection of
    the oldest generation, and the objects alive before it are frozen: such a collection scans
    every object of the triggerer holding the interpreter lock, and Airflow's triggerer warned
    that its event loop was blocked. The collector's own state is kept (enabled, or disabled)."""
    out = subprocess.run([sys.executable, "-c", FIRST_RUN_IMPORT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"full": 0, "scanned": False, "enabled": [True, False]}

"""The shared execution watcher: many triggers in one event loop, counted by the emulator.

Every test runs real triggers (:class:`CloudRunGpuExecutionTrigger`) in one event loop against
the emulator, on both transports, and reads the emulator's per-method request counters.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import subprocess
import sys

import pytest

from airflow_gpu_resilience.triggers import cloud_run, execution_watcher
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


@pytest.mark.parametrize("transport", ["grpc"], indirect=True)  # the watcher's scheduling, not its transport
def test_triggers_joining_a_running_watcher_wait_for_its_next_poll(hook, job_name, emulator):
    """A trigger that subscribes between two polls is served by the next one: no listing of its
    own (the watcher polls at once only when it starts)."""
    executions = [start(hook, f"{job_name}-{i}", ["sleep", "60"]) for i in range(4)]

    async def scenario():
        triggers = [CloudRunGpuExecutionTrigger(execution=name, poll_interval=3600.0, cancel_on_kill=False)
                    for name in executions]
        waiting = [asyncio.ensure_future(anext(triggers[0].run()))]
        watcher = await running_watcher()
        while watcher.watched[executions[0]].counts is None:  # the first poll has listed the region
            await asyncio.sleep(0.01)
        for trigger in triggers[1:]:  # one at a time, each subscribed before the next
            waiting.append(asyncio.ensure_future(anext(trigger.run())))
            while trigger.execution not in watcher.watched:
                await asyncio.sleep(0.01)
        for _ in range(20):  # a woken watcher would count its next poll within a few turns
            await asyncio.sleep(0)
        polls = watcher.polls
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await asyncio.wait_for(watcher.task, timeout=10)
        return polls, watcher

    emulator.requests(reset=True)
    try:
        polls, watcher = asyncio.run(scenario())
        assert (polls, watcher.polls) == (1, 1)
        assert reads(emulator)["ListExecutions"] == 1
    finally:
        for execution in executions:
            hook.cancel_execution(execution=execution, wait=True)


def test_a_poll_hands_the_loop_back_once_a_turn_has_held_it():
    """A poll's work on listed items yields to the other triggers after each time slice, whatever
    the items cost (the caller's work on each item counted): here a clock the items advance."""
    now = [0]

    async def turns_of(costs: list[int]) -> list[int]:
        ticks, seen = [0], []

        async def ticker():  # one tick per turn of the event loop
            while True:
                ticks[0] += 1
                await asyncio.sleep(0)

        ticking = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        async for cost in execution_watcher._in_turns(costs, turn=5, clock=lambda: now[0]):
            seen.append(ticks[0])
            now[0] += cost
        ticking.cancel()
        return [len(list(group)) for _, group in itertools.groupby(seen)]

    assert asyncio.run(turns_of([1] * 12)) == [5, 5, 2]
    assert asyncio.run(turns_of([1, 7, 1, 1, 9, 1])) == [2, 3, 1]
    assert asyncio.run(turns_of([])) == []


def test_triggers_starting_together_share_one_import_thread(tmp_path, monkeypatch):
    """Triggers that start in one turn of the loop wait for one thread's import of a module, not a
    thread each; a waiter cancelled meanwhile leaves the import to the others."""
    (tmp_path / "watch_import_probe.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "watch_import_probe", raising=False)
    monkeypatch.setattr(cloud_run, "_IMPORTED", {})

    class CountingExecutor(concurrent.futures.ThreadPoolExecutor):
        jobs = 0

        def submit(self, *args, **kwargs):
            CountingExecutor.jobs += 1
            return super().submit(*args, **kwargs)

    async def scenario():
        asyncio.get_running_loop().set_default_executor(CountingExecutor(max_workers=4))
        waiters = [asyncio.ensure_future(cloud_run._import("watch_import_probe")) for _ in range(50)]
        await asyncio.sleep(0)
        waiters[0].cancel()
        return await asyncio.gather(*waiters[1:])

    modules = asyncio.run(scenario())
    assert CountingExecutor.jobs == 1
    assert {module.VALUE for module in modules} == {42} and len({id(m) for m in modules}) == 1


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

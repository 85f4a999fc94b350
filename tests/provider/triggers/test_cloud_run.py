"""CloudRunGpuExecutionTrigger: exact serialize round-trip, and run() to each terminal status."""

from __future__ import annotations

import asyncio
import json
import warnings

import pytest

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.job_spec import GpuJobSpec
from airflow_gpu_resilience.outcome import AttemptRecord, OutcomeClass
from airflow_gpu_resilience.triggers.cloud_run import CloudRunGpuExecutionTrigger
from tests.provider.conftest import BUCKET, PROJECT, REGION, STUB_IMAGE, wait_until_running

MAINTENANCE = "Container instance preemption initiated by the platform due to underlying hardware maintenance."


def test_serialize_round_trip():
    kwargs = {
        "execution": "projects/p/locations/us-central1/jobs/j/executions/j-abcde",
        "gcp_conn_id": "my_conn",
        "impersonation_chain": ["a@p.iam.gserviceaccount.com"],
        "transport": "rest",
        "poll_interval": 2.5,
        "timeout": 30.0,
        "carry": {"reruns": 1, "executions": []},
        "cancel_on_kill": False,
    }
    trigger = CloudRunGpuExecutionTrigger(**kwargs)
    classpath, args = trigger.serialize()
    assert classpath == "airflow_gpu_resilience.triggers.cloud_run.CloudRunGpuExecutionTrigger"
    assert args == kwargs
    assert json.loads(json.dumps(args)) == args
    assert CloudRunGpuExecutionTrigger(**args).serialize() == (classpath, args)


@pytest.fixture
def hook(gcp_conn) -> CloudRunGpuHook:
    return CloudRunGpuHook(gcp_conn_id=gcp_conn)


def start(hook, job_name: str, args: list[str], max_retries: int = 0) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = GpuJobSpec(name=job_name, image=STUB_IMAGE, args=args, max_retries=max_retries, checkpoint_bucket=BUCKET)
    hook.create_job(job_name=job_name, job=spec, region=REGION, project_id=PROJECT)
    return hook.run_job(job_name=job_name, region=REGION, project_id=PROJECT)[1]


def run_trigger(execution: str, **kwargs) -> dict:
    trigger = CloudRunGpuExecutionTrigger(execution=execution, poll_interval=0.1, carry={"k": 1}, **kwargs)

    async def first_event():
        return await anext(trigger.run())

    event = asyncio.run(asyncio.wait_for(first_event(), timeout=60))
    assert json.loads(json.dumps(event.payload)) == event.payload
    return event.payload


def test_run_succeeded(hook, job_name):
    execution = start(hook, job_name, ["ok"])
    event = run_trigger(execution)
    assert (event["status"], event["execution"], event["carry"]) == ("succeeded", execution, {"k": 1})
    assert [(a["task_index"], a["attempt"], a["exit_code"]) for a in event["attempts"]] == [(0, 0, 0)]


def test_run_failed(hook, job_name):
    execution = start(hook, job_name, ["exit", "3"], max_retries=1)
    event = run_trigger(execution)
    assert event["status"] == "failed"
    assert "failed" in event["message"]
    assert [a["exit_code"] for a in event["attempts"]][-1] == 3


def test_run_cancelled(hook, job_name):
    execution = start(hook, job_name, ["sleep", "60"])
    hook.cancel_execution(execution=execution)
    assert run_trigger(execution)["status"] == "cancelled"


def test_run_timeout(hook, job_name):
    execution = start(hook, job_name, ["sleep", "60"])
    try:
        event = run_trigger(execution, timeout=0.3)
        assert event["status"] == "timeout" and "still running after 0.3 s" in event["message"]
    finally:
        hook.cancel_execution(execution=execution, wait=True)


def test_run_error_for_a_missing_execution(hook, job_name):
    start(hook, job_name, ["ok"])
    missing = f"projects/{PROJECT}/locations/{REGION}/jobs/{job_name}/executions/{job_name}-zzzzz"
    event = run_trigger(missing)
    assert event["status"] == "error" and "NotFound" in event["message"]


def test_run_records_a_maintenance_preemption_retried_inside_the_execution(hook, job_name, emulator):
    # the retry runs 3 s, so that a poll sees it running (its attempt 0 result still there)
    execution = start(hook, job_name, ["sleep-first", "60", "3"], max_retries=1)
    wait_until_running(hook, execution)
    trigger = CloudRunGpuExecutionTrigger(execution=execution, poll_interval=0.05)

    async def preempt_while_polling():
        polling = asyncio.ensure_future(anext(trigger.run()))
        await asyncio.to_thread(emulator.preempt, execution, 0, 0.5)
        return await asyncio.wait_for(polling, timeout=30)

    event = asyncio.run(preempt_while_polling()).payload
    assert event["status"] == "succeeded"
    first, last = (AttemptRecord.from_dict(a) for a in event["attempts"])
    assert (first.attempt, first.exit_code, first.term_signal) == (0, None, 15)
    assert first.message == MAINTENANCE and first.classify() is OutcomeClass.PREEMPTED
    assert (last.attempt, last.exit_code, last.classify()) == (1, 0, OutcomeClass.SUCCEEDED)


def test_on_kill_cancels_the_execution(hook, job_name):
    execution = start(hook, job_name, ["sleep", "60"])
    asyncio.run(CloudRunGpuExecutionTrigger(execution=execution).on_kill())
    assert run_trigger(execution)["status"] == "cancelled"


def test_on_kill_leaves_a_watched_execution_alone(hook, job_name):
    execution = start(hook, job_name, ["sleep", "60"])
    try:
        asyncio.run(CloudRunGpuExecutionTrigger(execution=execution, cancel_on_kill=False).on_kill())
        assert run_trigger(execution, timeout=0.3)["status"] == "timeout"
    finally:
        hook.cancel_execution(execution=execution, wait=True)


def test_run_keeps_waiting_through_transient_errors(hook, job_name, faults, monkeypatch):
    """503s and 429s on every read for a while delay the watcher's polls (backoff, capped here at
    2 s to keep the test short) and never end the wait."""
    from airflow_gpu_resilience.triggers import watch_rules

    execution = start(hook, job_name, ["sleep", "1"])
    monkeypatch.setattr(watch_rules, "BACKOFF_CAP_SECONDS", 2.0)
    faults(failNext=8, codes=[503, 429])
    assert run_trigger(execution)["status"] == "succeeded"


def _cancel_run_while_polling(execution: str, state: str, monkeypatch) -> None:
    """Run the trigger, then cancel its task with no message (as a triggerer does when the
    message gets lost, and as Airflow before 3.3 always does), twice (the triggerer repeats it
    while the trigger has not ended), the task instance in ``state``."""
    from types import SimpleNamespace

    import airflow_gpu_resilience.triggers.cloud_run as module

    async def fake_state(ti):
        await asyncio.sleep(0.5)  # a slow answer: the triggerer repeats the cancel meanwhile
        return state

    monkeypatch.setattr(module, "_task_instance_state", fake_state)
    trigger = CloudRunGpuExecutionTrigger(execution=execution, poll_interval=0.1)
    trigger.task_instance = SimpleNamespace(dag_id="d", task_id="t", run_id="r", map_index=-1)

    async def cancel_while_polling():
        polling = asyncio.ensure_future(anext(trigger.run()))
        await asyncio.sleep(1.0)
        polling.cancel()
        await asyncio.sleep(0.2)
        polling.cancel()  # the triggerer cancels again at each loop until the trigger has ended
        with pytest.raises(asyncio.CancelledError):
            await polling
        await asyncio.sleep(3.0)  # the triggerer's loop keeps running; so does the shielded cancel

    asyncio.run(cancel_while_polling())


def test_run_cancelled_after_the_user_marked_the_task_failed_cancels_the_execution(hook, job_name, monkeypatch):
    execution = start(hook, job_name, ["sleep", "60"])
    _cancel_run_while_polling(execution, "failed", monkeypatch)
    assert run_trigger(execution)["status"] == "cancelled"


def test_run_cancelled_while_still_deferred_leaves_the_execution_running(hook, job_name, monkeypatch):
    """A triggerer shutdown or restart cancels the trigger with the task still deferred."""
    execution = start(hook, job_name, ["sleep", "60"])
    try:
        _cancel_run_while_polling(execution, "deferred", monkeypatch)
        assert run_trigger(execution, timeout=0.3)["status"] == "timeout"
    finally:
        hook.cancel_execution(execution=execution, wait=True)

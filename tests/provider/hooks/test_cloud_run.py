"""CloudRunGpuHook against the local Cloud Run emulator (no client mocks)."""

from __future__ import annotations

import functools

import pytest
from google.api_core import exceptions as gexc
from google.cloud import run_v2

from airflow_gpu_resilience.execution_watch import ExecutionWatch, PollState
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.hooks.cloud_run_executions import location_of
from airflow_gpu_resilience.hooks.cloud_run_retry import error_status
from airflow_gpu_resilience.overrides import START_ID_ENV, execution_env, with_env_overrides
from airflow_gpu_resilience.exceptions import CloudRunJobNotOursError
from airflow_gpu_resilience.job_spec import GpuJobSpec
from airflow_gpu_resilience.outcome import (
    ExecutionState,
    OutcomeClass,
    classify_task,
    execution_state,
    observe_attempts,
)
from tests.provider.conftest import BUCKET, PROJECT, REGION, STUB_IMAGE


JOB_LABEL = {"managed-by": "airflow-gpu-resilience"}
#: For tests of the REST route (the connection's ``api_endpoint``); the gRPC route is tested in
#: test_cloud_run_clients.py.
REST_ONLY = pytest.mark.parametrize("transport", ["rest"], indirect=True)


def spec(job_name: str, **kw) -> GpuJobSpec:
    return GpuJobSpec(name=job_name, image=STUB_IMAGE, checkpoint_bucket=BUCKET, **kw)


@pytest.fixture
def hook(gcp_conn) -> CloudRunGpuHook:
    return CloudRunGpuHook(gcp_conn_id=gcp_conn)


@REST_ONLY
def test_endpoint_and_transport_come_from_the_connection(hook, emulator):
    assert hook.api_endpoint == emulator.endpoint
    assert hook.transport == "rest"
    assert hook.project_id == PROJECT


@REST_ONLY
def test_clients_take_credentials_and_endpoint_from_the_google_base_hook(hook, emulator, monkeypatch):
    """The connection decides the credentials (``is_anonymous`` here), not the endpoint's scheme."""
    from google.auth.credentials import AnonymousCredentials
    from google.oauth2.credentials import Credentials

    assert isinstance(hook.jobs_client(REGION)._transport._credentials, AnonymousCredentials)
    token = Credentials(token="from-the-connection")
    monkeypatch.setattr(hook, "get_credentials", lambda: token)
    client = hook.executions_client("europe-west4")
    assert client._transport._credentials is token
    assert client.api_endpoint == emulator.endpoint


def test_clients_are_cached_per_location(hook):
    assert hook.jobs_client("us-central1") is hook.jobs_client("us-central1")
    assert hook.jobs_client("us-central1") is not hook.jobs_client("europe-west4")
    assert hook.tasks_client("us-central1") is not hook.jobs_client("us-central1")


def test_location_of():
    assert location_of("projects/p/locations/europe-west4/jobs/j/executions/e") == "europe-west4"
    with pytest.raises(ValueError, match="not a projects/"):
        location_of("jobs/j")


def test_create_get_update_delete(hook, job_name):
    created = hook.create_job(job_name=job_name, job=spec(job_name), region=REGION)
    assert created.name == f"projects/{PROJECT}/locations/{REGION}/jobs/{job_name}"
    assert created.template.template.node_selector.accelerator == "nvidia-l4"
    fetched = hook.get_job(job_name=job_name, region=REGION)
    assert fetched.generation == created.generation
    updated = hook.update_job(job_name=job_name, job=spec(job_name, args=["exit", "0"]), region=REGION)
    assert updated.generation > created.generation
    assert list(updated.template.template.containers[0].args) == ["exit", "0"]
    assert hook.delete_job(job_name=job_name, region=REGION) is not None
    with pytest.raises(gexc.NotFound):
        hook.get_job(job_name=job_name, region=REGION)
    assert hook.delete_job(job_name=job_name, region=REGION) is None


def test_create_existing_job_raises_conflict(hook, job_name):
    hook.create_job(job_name=job_name, job=spec(job_name), region=REGION)
    with pytest.raises(gexc.Conflict, match="already exists"):
        hook.create_job(job_name=job_name, job=spec(job_name), region=REGION)


def test_create_or_update_is_idempotent(hook, job_name):
    job, action = hook.create_or_update_job(job_name=job_name, job=spec(job_name), region=REGION)
    assert action == "created"
    again, action = hook.create_or_update_job(job_name=job_name, job=spec(job_name), region=REGION)
    assert (action, again.generation) == ("unchanged", job.generation)
    changed, action = hook.create_or_update_job(job_name=job_name, job=spec(job_name, max_retries=1), region=REGION)
    assert action == "updated" and changed.generation > job.generation
    assert changed.template.template.max_retries == 1


def test_create_or_update_labels_the_job_it_creates(hook, job_name):
    job, action = hook.create_or_update_job(job_name=job_name, job=spec(job_name, labels={"team": "ml"}), region=REGION)
    assert action == "created"
    assert dict(hook.get_job(job_name=job_name, region=REGION).labels) == {"team": "ml", **JOB_LABEL}


@pytest.mark.parametrize("labels", [{}, {"managed-by": "someone-else"}], ids=["no-labels", "other-manager"])
def test_create_or_update_refuses_a_job_that_is_not_ours_and_changes_nothing(hook, job_name, labels):
    theirs = hook.create_job(job_name=job_name, job=spec(job_name, labels=labels, args=["theirs"]), region=REGION)
    for desired in (spec(job_name, args=["ours"]), spec(job_name, labels=labels, args=["theirs"])):
        with pytest.raises(CloudRunJobNotOursError, match="not deployed by airflow-gpu-resilience") as err:
            hook.create_or_update_job(job_name=job_name, job=desired, region=REGION)
        assert err.value.job == theirs.name and "adopt_existing_job=True" in str(err.value)
    after = hook.get_job(job_name=job_name, region=REGION)
    assert after.generation == theirs.generation and dict(after.labels) == labels
    assert list(after.template.template.containers[0].args) == ["theirs"]


def test_create_or_update_adopts_a_job_that_is_not_ours_only_when_asked(hook, job_name):
    theirs = hook.create_job(job_name=job_name, job=spec(job_name), region=REGION)
    adopted, action = hook.create_or_update_job(job_name=job_name, job=spec(job_name), region=REGION,
                                                adopt_existing_job=True)
    assert action == "updated" and adopted.generation > theirs.generation
    assert dict(adopted.labels) == JOB_LABEL
    again, action = hook.create_or_update_job(job_name=job_name, job=spec(job_name), region=REGION)
    assert (action, again.generation) == ("unchanged", adopted.generation)


def test_run_poll_and_list(hook, job_name):
    hook.create_job(job_name=job_name, job=spec(job_name, task_count=2, max_retries=0), region=REGION)
    operation, execution = hook.run_job(
        job_name=job_name, region=REGION, overrides={"container_overrides": [{"args": ["exit", "1"]}]}
    )
    assert "/operations/" in operation
    assert execution.startswith(f"projects/{PROJECT}/locations/{REGION}/jobs/{job_name}/executions/{job_name}-")
    polled = []
    final = hook.wait_for_execution(execution, poll_interval=0.2, timeout=60, on_poll=lambda e, t: polled.append(len(t)))
    assert execution_state(final) is ExecutionState.FAILED
    assert polled and polled[-1] == 2
    tasks = hook.list_tasks(execution=execution)
    assert [t.index for t in tasks] == [0, 1]
    outcomes = {classify_task(t).outcome for t in tasks}
    assert OutcomeClass.FAILED in outcomes
    assert [e.name for e in hook.list_executions(job_name=job_name, region=REGION)] == [execution]
    short = execution.rsplit("/", 1)[-1]
    assert hook.get_execution(execution=short, job_name=job_name, region=REGION).name == execution
    assert hook.get_operation(operation).done is True


def test_a_domain_scoped_project_deploys_runs_and_lists(hook, job_name):
    """A domain-scoped project id (``example.com:my-project``, a legal Google Cloud project id)
    goes into Cloud Run's names as it is, on both transports: the job, its run (the ``:run``
    verb after a project segment with a colon), the wait and the listing."""
    project = "example.com:test-project"
    created = hook.create_job(job_name=job_name, job=spec(job_name, max_retries=0), region=REGION, project_id=project)
    assert created.name == f"projects/{project}/locations/{REGION}/jobs/{job_name}"
    _, execution = hook.run_job(job_name=job_name, region=REGION, project_id=project)
    assert execution_state(hook.wait_for_execution(execution, poll_interval=0.1, timeout=60)) is ExecutionState.SUCCEEDED
    assert [e.name for e in hook.list_executions(job_name=job_name, region=REGION, project_id=project)] == [execution]
    with pytest.raises(gexc.NotFound):  # another project than the default one
        hook.get_job(job_name=job_name, region=REGION)


def test_short_execution_name_needs_job_and_region(hook):
    with pytest.raises(ValueError, match="short name"):
        hook.get_execution(execution="abc")


def test_cancel_execution(hook, job_name):
    hook.create_job(job_name=job_name, job=spec(job_name, args=["sleep", "60"]), region=REGION)
    _, execution = hook.run_job(job_name=job_name, region=REGION)
    cancelled = hook.cancel_execution(execution=execution, wait=True)
    assert isinstance(cancelled, run_v2.Execution)
    final = hook.wait_for_execution(execution, poll_interval=0.2, timeout=30)
    assert execution_state(final) is ExecutionState.CANCELLED


def test_a_cancelled_attempt_is_recorded_as_cancelled_not_preempted(hook, job_name):
    """Cancelling stops the container with SIGTERM, like a preemption; the attempt record (what the
    execute operator logs per attempt) is CANCELLED, from the attempt's CANCELLED status."""
    from tests.provider.conftest import wait_until_running

    hook.create_job(job_name=job_name, job=spec(job_name, args=["sleep", "60"], max_retries=0), region=REGION)
    _, execution = hook.run_job(job_name=job_name, region=REGION)
    wait_until_running(hook, execution)
    hook.cancel_execution(execution=execution, wait=True)
    hook.wait_for_execution(execution, poll_interval=0.2, timeout=30)
    [record] = observe_attempts(hook.list_tasks(execution=execution))
    assert record.term_signal == 15 or record.exit_code == 143  # the stop's trace
    assert record.status_code == 1 and "cancelled" in record.message
    assert record.classify() is OutcomeClass.CANCELLED


def test_wait_for_execution_times_out(hook, job_name):
    hook.create_job(job_name=job_name, job=spec(job_name, args=["sleep", "30"]), region=REGION)
    _, execution = hook.run_job(job_name=job_name, region=REGION)
    try:
        with pytest.raises(TimeoutError, match="still running"):
            hook.wait_for_execution(execution, poll_interval=0.2, timeout=0.5)
    finally:
        hook.cancel_execution(execution=execution, wait=True)


def test_transient_errors_are_retried_with_backoff(hook, job_name, faults):
    hook.create_job(job_name=job_name, job=spec(job_name), region=REGION)
    faults(failNext=2, codes=[503, 429])
    assert hook.get_job(job_name=job_name, region=REGION).name.endswith(job_name)
    faults(failNext=1, codes=[503])
    _, execution = hook.run_job(job_name=job_name, region=REGION)
    assert execution


def test_persistent_errors_surface_after_the_retry_deadline(hook, job_name, faults, monkeypatch):
    from airflow_gpu_resilience.hooks import cloud_run

    monkeypatch.setattr(cloud_run, "default_retry", functools.partial(cloud_run.default_retry, deadline=0.5))
    faults(errorRate=1.0, codes=[503])
    with pytest.raises(gexc.RetryError):
        hook.get_job(job_name=job_name, region=REGION)


def test_start_execution_marks_the_request_and_survives_503s(hook, job_name, faults):
    hook.create_job(job_name=job_name, job=spec(job_name, args=["ok"]), region=REGION)
    faults(failNext=3, codes=[503])
    name = hook.start_execution(job_name=job_name, region=REGION, overrides={"task_count": 1})
    [execution] = hook.list_executions(job_name=job_name, region=REGION)
    assert execution.name == name
    env = execution_env(execution)
    assert len(env[START_ID_ENV]) == 32
    assert hook.find_executions(job_name=job_name, region=REGION, env={START_ID_ENV: env[START_ID_ENV]})
    assert hook.find_executions(job_name=job_name, region=REGION, env={START_ID_ENV: "other"}) == []


def test_with_env_overrides_keeps_user_overrides_and_replaces_same_names():
    user = {"task_count": 2, "container_overrides": [{"args": ["a"], "env": [{"name": "X", "value": "1"}]}]}
    merged = with_env_overrides(user, {"X": "2", "Y": "3"})
    assert merged == {"task_count": 2, "container_overrides": [
        {"args": ["a"], "env": [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}]}]}
    assert user["container_overrides"][0]["env"] == [{"name": "X", "value": "1"}]  # unchanged
    assert with_env_overrides(None, {"K": "v"}) == {"container_overrides": [{"env": [{"name": "K", "value": "v"}]}]}


@REST_ONLY
def test_rest_error_status_comes_from_the_body_not_the_http_code(hook, job_name):
    """FAILED_PRECONDITION arrives over REST as BadRequest (class code INVALID_ARGUMENT)."""
    hook.create_job(job_name=job_name, job=spec(job_name, args=["sleep", "60"]), region=REGION)
    _, execution = hook.run_job(job_name=job_name, region=REGION)
    try:
        with pytest.raises(gexc.BadRequest) as info:
            hook.delete_execution(execution=execution)
        assert error_status(info.value) == "FAILED_PRECONDITION"
        assert not isinstance(info.value, gexc.FailedPrecondition)
    finally:
        hook.cancel_execution(execution=execution, wait=True)
    assert hook.cancel_execution(execution=execution).name == execution  # finished: no error
    hook.delete_execution(execution=execution)
    with pytest.raises(gexc.NotFound) as info:
        hook.get_execution(execution=execution)
    assert error_status(info.value) == "NOT_FOUND"


def test_the_shared_poll_step_sleeps_up_to_the_deadline_and_records_attempts_once():
    """ExecutionWatch.step is the pure step of both waits (the hook's and the trigger's)."""
    from google.protobuf import timestamp_pb2

    running = run_v2.Execution(task_count=1)
    done_at = timestamp_pb2.Timestamp(seconds=100)
    finished = run_v2.Execution(task_count=1, succeeded_count=1, completion_time=done_at)
    task = run_v2.Task(index=0, retried=0, completion_time=done_at, last_attempt_result=run_v2.TaskAttemptResult())
    watch = ExecutionWatch(poll_interval=10.0, timeout=25.0, started=0.0)
    step = watch.step(None, [], now=0.0)  # a transient error: poll again
    assert (step.state, step.sleep_seconds) == (PollState.WAIT, 10.0)
    assert watch.step(running, [], now=0.0) == step
    assert watch.step(None, [], now=20.0).sleep_seconds == 5.0  # never sleeps past the deadline
    assert watch.step(running, [task], now=25.0).state is PollState.TIMED_OUT
    assert watch.step(finished, [task], now=26.0).state is PollState.FINISHED  # finished beats the deadline
    assert [r.key for r in watch.attempts.records] == [(0, 0)]  # seen twice, recorded once
    assert ExecutionWatch(poll_interval=2.0, timeout=None, started=0.0).step(running, [], now=1e9).sleep_seconds == 2.0


def test_wait_for_execution_polls_through_persistent_errors(hook, job_name, faults, monkeypatch):
    from airflow_gpu_resilience.hooks import cloud_run_executions

    hook.create_job(job_name=job_name, job=spec(job_name, args=["sleep", "1"]), region=REGION)
    _, execution = hook.run_job(job_name=job_name, region=REGION)
    monkeypatch.setattr(cloud_run_executions, "default_retry",
                        functools.partial(cloud_run_executions.default_retry, deadline=0.2))
    faults(failNext=6, codes=[503])
    final = hook.wait_for_execution(execution, poll_interval=0.2, timeout=30)
    assert execution_state(final) is ExecutionState.SUCCEEDED


def test_delete_job_when_idle_never_deletes_under_a_running_execution(hook, job_name):
    """The teardown's delete (issue 14): with an execution running and no wait, the job is kept and
    the result names the execution; ``keep_job`` keeps it; after a cancel the delete waits for the
    execution to end, then deletes; a second call finds the job absent."""
    from tests.provider.conftest import wait_until_running

    from airflow_gpu_resilience.job_cleanup import JobCleanupAction

    hook.create_or_update_job(job_name=job_name, job=spec(job_name, args=["sleep", "60"], max_retries=0),
                              region=REGION)
    _, execution = hook.run_job(job_name=job_name, region=REGION)
    wait_until_running(hook, execution)
    kept = hook.delete_job_when_idle(job_name=job_name, region=REGION, wait_seconds=0, poll_interval=0.2)
    assert (kept.action, kept.unended_executions) == (JobCleanupAction.KEEP_RUNNING, (execution,))
    assert hook.get_job(job_name=job_name, region=REGION).name.endswith(job_name)
    requested = hook.delete_job_when_idle(job_name=job_name, region=REGION, keep_job=True)
    assert requested.action is JobCleanupAction.KEEP_REQUESTED

    hook.cancel_execution(execution=execution)  # not waited for: the delete must wait itself
    deleted = hook.delete_job_when_idle(job_name=job_name, region=REGION, wait_seconds=60, poll_interval=0.2)
    assert deleted.action is JobCleanupAction.DELETE and deleted.unended_executions == ()
    with pytest.raises(gexc.NotFound):
        hook.get_job(job_name=job_name, region=REGION)
    assert hook.delete_job_when_idle(job_name=job_name, region=REGION).action is JobCleanupAction.ABSENT


def test_delete_job_when_idle_keeps_a_job_that_is_not_ours_and_checks_its_arguments_first(hook, job_name):
    from airflow_gpu_resilience.job_cleanup import JobCleanupAction

    hook.create_job(job_name=job_name, job=spec(job_name), region=REGION)  # create_job adds no label
    assert hook.delete_job_when_idle(job_name=job_name, region=REGION).action is JobCleanupAction.KEEP_NOT_OURS
    assert hook.get_job(job_name=job_name, region=REGION).name.endswith(job_name)
    with pytest.raises(ValueError, match="wait_seconds must be >= 0"):
        hook.delete_job_when_idle(job_name=job_name, region=REGION, wait_seconds=-1)
    with pytest.raises(ValueError, match="poll_interval must be > 0"):
        hook.delete_job_when_idle(job_name=job_name, region=REGION, poll_interval=0)


def test_a_cpu_only_job_deploys_and_runs_without_a_gpu(hook, job_name):
    with pytest.warns(UserWarning, match="CPU-only"):
        cpu_only = spec(job_name, gpu_type=None, cpu="1", memory="512Mi", task_timeout=72 * 3600)
    job, action = hook.create_or_update_job(job_name=job_name, job=cpu_only, region=REGION)
    assert action == "created"
    task = job.template.template
    assert "nvidia.com/gpu" not in task.containers[0].resources.limits and not task.node_selector.accelerator
    _, execution = hook.run_job(job_name=job_name, region=REGION)
    final = hook.wait_for_execution(execution, poll_interval=0.2, timeout=60)
    assert execution_state(final) is ExecutionState.SUCCEEDED
    assert hook.create_or_update_job(job_name=job_name, job=cpu_only, region=REGION)[1] == "unchanged"

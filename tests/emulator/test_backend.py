"""Backend, validation, image table and model tests without HTTP."""

from __future__ import annotations

import itertools
import os
import sys
import time

import pytest
from google.api import launch_stage_pb2
from google.cloud import run_v2
from google.longrunning import operations_pb2
from google.protobuf import json_format

from cloud_run_emulator import validation
from cloud_run_emulator.backend import CloudRunBackend, Registry, paginate
from cloud_run_emulator.exceptions import (
    AlreadyExists, FailedPrecondition, InvalidArgument, NotFound,
)
from cloud_run_emulator.faults import (
    MIN_GAP_SECONDS, ApiFaults, FaultConfig, PreemptionPlan, PreemptionSchedule,
)
from cloud_run_emulator.images import ImageTable
from cloud_run_emulator.overrides import apply_overrides
from cloud_run_emulator.models import (
    TASK_TRANSITIONS, ExecutionState, TaskState, transition,
)
from cloud_run_emulator.runtime import RuntimeConfig, RuntimePolicy, rewrite

from .conftest import PARENT, make_job


class FakeGcs:
    """Buckets are plain directories; reconcile calls are recorded."""

    endpoint = "http://127.0.0.1:9"

    def __init__(self, root, buckets=("ckpt",)):
        self.root, self.buckets, self.reconciled = root, set(buckets), []

    def bucket_exists(self, bucket):
        return bucket in self.buckets

    def bucket_dir(self, bucket):
        return self.root / bucket

    def reconcile(self, buckets):
        self.reconciled.append(list(buckets))


@pytest.fixture
def registry(tmp_path):
    images = ImageTable({"ok": {"entrypoint": ["{python}", "-c", "import sys; sys.exit(0)"]},
                         "fail": {"entrypoint": ["{python}", "-c", "import sys; sys.exit(3)"]}}, tmp_path)
    config = RuntimeConfig(data_dir=tmp_path, images=images, gcs=FakeGcs(tmp_path), policy=RuntimePolicy(poll_seconds=0.01))
    reg = Registry(config, "http://127.0.0.1:1")
    yield reg
    reg.shutdown(0.5)


@pytest.fixture
def backend(registry) -> CloudRunBackend:
    return registry.for_name(PARENT)


def test_create_fills_defaults_and_rejects_duplicates(backend):
    op = backend.create_job("j1", make_job("ok"))
    assert op.done and op.target.name == f"{PARENT}/jobs/j1"
    job = backend.get_job(f"{PARENT}/jobs/j1").to_proto()
    assert job.template.task_count == 1 and job.template.template.max_retries == 3
    assert job.template.template.timeout.total_seconds() == 600 and job.launch_stage == launch_stage_pb2.GA
    with pytest.raises(AlreadyExists):
        backend.create_job("j1", make_job("ok"))
    with pytest.raises(NotFound):
        backend.get_job(f"{PARENT}/jobs/nope")


def test_run_to_success_and_failure_without_http(backend, registry):
    backend.create_job("good", make_job("ok", task_count=2, bucket="ckpt"))
    backend.create_job("bad", make_job("fail", max_retries=2))
    good = backend.wait_operation(backend.run_job(f"{PARENT}/jobs/good").name, 20)
    bad = backend.wait_operation(backend.run_job(f"{PARENT}/jobs/bad").name, 20)
    assert good.done and good.error is None and good.target.state is ExecutionState.SUCCEEDED
    assert good.target.to_proto().succeeded_count == 2
    assert registry.config.gcs.reconciled and all(b == ["ckpt"] for b in registry.config.gcs.reconciled)
    assert bad.done and bad.error[0] == 9 and "bad-" in bad.error[1]
    task = bad.target.tasks[0]
    assert task.retried == 2 and task.last_result.exit_code == 3 and task.state is TaskState.FAILED


def test_operation_json_parses_strictly_as_the_client_does(backend):
    backend.create_job("j", make_job("ok"))
    op = backend.wait_operation(backend.run_job(f"{PARENT}/jobs/j").name, 20)
    text = json_format.MessageToJson(op.to_pb(), use_integers_for_enums=False)
    parsed = json_format.Parse(text, operations_pb2.Operation())  # strict: unknown fields raise
    execution = run_v2.Execution.pb(run_v2.Execution())
    assert parsed.response.Unpack(execution) and execution.succeeded_count == 1
    assert parsed.metadata.type_url == "type.googleapis.com/google.cloud.run.v2.Execution"


def test_overrides_replace_args_merge_env_and_clear():
    template = make_job("ok", env={"A": "1", "B": "2"}, args=["x"], task_count=1).template
    overrides = run_v2.RunJobRequest.Overrides(
        container_overrides=[{"args": ["y"], "env": [{"name": "B", "value": "3"}]}], task_count=4,
        timeout={"seconds": 30})
    task_template, count = apply_overrides(template, overrides)
    container = task_template.containers[0]
    assert list(container.args) == ["y"] and {e.name: e.value for e in container.env} == {"A": "1", "B": "3"}
    assert count == 4 and task_template.timeout.total_seconds() == 30
    cleared, _ = apply_overrides(
        template, run_v2.RunJobRequest.Overrides(container_overrides=[{"clear_args": True}]))
    assert list(cleared.containers[0].args) == [] and list(template.template.containers[0].args) == ["x"]
    with pytest.raises(InvalidArgument, match="container_overrides"):
        apply_overrides(
            template, run_v2.RunJobRequest.Overrides(container_overrides=[{"name": "other"}]))


def _slow(backend, tmp_path, job_id, **kw):
    backend.registry.config.images = ImageTable(
        {"slow": {"entrypoint": ["{python}", "-c", "import time; time.sleep(30)"]}}, tmp_path)
    backend.create_job(job_id, make_job("slow", **kw))
    return backend.run_job(f"{PARENT}/jobs/{job_id}")


def test_preempt_records_maintenance_status(backend, tmp_path):
    op = _slow(backend, tmp_path, "slow", max_retries=0)
    answer = backend.preempt(op.target.name, 0, grace_s=5.0, wait_s=5.0)
    assert answer["attempt"] == 0 and answer["task"].endswith("-task0")
    with pytest.raises(FailedPrecondition, match="not running"):  # stopping or stopped already
        backend.preempt(op.target.name, 0, grace_s=5.0, wait_s=0.0)
    assert backend.wait_operation(op.name, 20).error[0] == 9
    result = op.target.tasks[0].last_result
    assert result.status_code == 14 and result.term_signal == 15 and result.exit_code is None


def test_cancel_execution_without_http(backend, tmp_path):
    op = _slow(backend, tmp_path, "slow", task_count=3, parallelism=1)
    cancel = backend.cancel_execution(op.target.name)
    assert backend.wait_operation(cancel.name, 20).done
    assert op.done and op.error is None and op.target.state is ExecutionState.CANCELLED
    assert all(t.state is TaskState.CANCELLED for t in op.target.tasks)
    assert op.target.to_proto().cancelled_count == 3


def test_delete_job_refuses_running_and_checks_etag(backend):
    backend.create_job("j", make_job("ok"))
    with pytest.raises(FailedPrecondition, match="etag"):
        backend.delete_job(f"{PARENT}/jobs/j", etag='"other"')
    etag = backend.get_job(f"{PARENT}/jobs/j").etag
    assert backend.delete_job(f"{PARENT}/jobs/j", etag=etag).done
    with pytest.raises(NotFound):
        backend.get_job(f"{PARENT}/jobs/j")


def test_illegal_transition_is_refused(backend):
    backend.create_job("j", make_job("ok"))
    op = backend.wait_operation(backend.run_job(f"{PARENT}/jobs/j").name, 20)
    task = op.target.tasks[0]
    with pytest.raises(RuntimeError, match="SUCCEEDED -> RUNNING"):
        transition(task, TaskState.RUNNING, TASK_TRANSITIONS)


def test_paginate():
    assert paginate(list(range(5)), 2, "") == ([0, 1], "2")
    assert paginate(list(range(5)), 2, "4") == ([4], "")
    with pytest.raises(InvalidArgument):
        paginate([], 1, "x")


def _gpu_job(accelerator="nvidia-l4", cpu="4", memory="16Gi", gpus="1", timeout_s=600, stage=None):
    job = make_job("ok", gpu=True, timeout_s=timeout_s, launch_stage=stage)
    container = job.template.template.containers[0]
    container.resources.limits.update({"cpu": cpu, "memory": memory, "nvidia.com/gpu": gpus})
    job.template.template.node_selector.accelerator = accelerator
    return job


@pytest.mark.parametrize("job, field", [
    (_gpu_job(gpus="2"), "resources.limits"),
    (_gpu_job(accelerator="nvidia-a100"), "node_selector.accelerator"),
    (_gpu_job(cpu="2"), "resources.limits.cpu"),
    (_gpu_job(memory="8Gi"), "resources.limits.memory"),
    (_gpu_job(accelerator="nvidia-rtx-pro-6000", cpu="20", memory="80Gi"), "launch_stage"),
    (_gpu_job(timeout_s=4000), "launch_stage"),
    (make_job("ok", timeout_s=169 * 3600, launch_stage=3), "timeout"),
    (make_job("ok", max_retries=-1), "max_retries"),
    (make_job("ok", bucket="missing"), "gcs.bucket"),
    (make_job("", ), "image"),
])
def test_validation_names_the_field(job, field):
    with pytest.raises(InvalidArgument, match=field):
        validation.validate_job(job, lambda b: b == "ckpt")


def test_validation_preview_features_report_beta():
    beta = launch_stage_pb2.BETA
    job = _gpu_job(accelerator="nvidia-rtx-pro-6000", cpu="20", memory="80Gi", stage=beta)
    assert validation.validate_job(job, lambda b: True) == beta
    assert validation.validate_job(_gpu_job(timeout_s=4000, stage=launch_stage_pb2.ALPHA), lambda b: True) == beta
    assert validation.validate_job(_gpu_job(stage=beta), lambda b: True) == launch_stage_pb2.GA
    assert validation.parse_memory_gib("16384Mi", "f") == 16 and validation.parse_cpu("4000m", "f") == 4


def test_rewrite_maps_mount_paths_only():
    mounts = [("/checkpoints", "/data/b")]
    assert rewrite("/checkpoints", mounts) == "/data/b"
    assert rewrite("/checkpoints/run/1", mounts) == "/data/b/run/1"
    assert rewrite("--dir=/checkpoints/x", mounts) == "--dir=/data/b/x"
    assert rewrite("/checkpointsX", mounts) == "/checkpointsX"
    assert rewrite("a=/checkpoints", mounts) == "a=/checkpoints"


def test_image_table_resolution_and_docker_semantics(tmp_path):
    table = ImageTable({
        "repo/app:*": {"entrypoint": ["{python}", "-m", "app"], "cmd": ["serve"], "cwd": "src",
                       "env": {"PYTHONPATH": "lib:/abs"}},
        "repo/app:1": {"entrypoint": ["exact"]},
    }, tmp_path)
    assert table.resolve("repo/app:1").entrypoint == ("exact",)
    entry = table.resolve("repo/app:2")
    assert entry.argv([], []) == [sys.executable, "-m", "app", "serve"]
    assert entry.argv([], ["train"]) == [sys.executable, "-m", "app", "train"]
    assert entry.argv(["bash"], []) == ["bash"]
    assert entry.cwd == (tmp_path / "src").resolve()
    assert entry.env["PYTHONPATH"] == f"{(tmp_path / 'lib').resolve()}:/abs"
    assert table.resolve("other") is None


def test_api_faults_fail_next_then_rate():
    faults = ApiFaults()
    faults.configure(FaultConfig.from_json({"failNext": 2, "codes": [429]}))
    results = [faults.next_fault()[1] for _ in range(3)]
    assert [type(r).__name__ if r else None for r in results] == ["ResourceExhausted"] * 2 + [None]
    faults.configure(FaultConfig.from_json({"errorRate": 1.0}))
    assert faults.next_fault()[1].http_code == 503
    with pytest.raises(InvalidArgument):
        FaultConfig.from_json({"codes": [500]})


def test_wait_operation_times_out(backend, tmp_path):
    op = _slow(backend, tmp_path, "slow")
    assert not backend.wait_operation(op.name, 0.2).done


def test_reset_stops_processes_and_forgets_resources(registry, tmp_path):
    backend = registry.for_name(PARENT)
    op = _slow(backend, tmp_path, "slow")
    backend.preempt(op.target.name, 0, grace_s=30.0, wait_s=5.0)  # wait until it runs
    popen = backend.supervisors[op.target.name].running[0].popen
    registry.reset()
    assert popen.poll() is not None
    with pytest.raises(NotFound):
        registry.for_name(PARENT).get_job(f"{PARENT}/jobs/slow")


def test_free_preemption_and_start_delay(backend, tmp_path):
    config = backend.registry.config
    config.policy.preemption_consumes_retry, config.policy.start_delay_seconds = False, 0.3
    config.images = ImageTable({"once": {"entrypoint": [
        "{python}", "-c", "import os,time; os.environ['CLOUD_RUN_TASK_ATTEMPT'] == '0' and time.sleep(30)"]}}, tmp_path)
    backend.create_job("once", make_job("once", max_retries=0))
    op = backend.run_job(f"{PARENT}/jobs/once")
    backend.preempt(op.target.name, 0, grace_s=5.0, wait_s=5.0)
    assert backend.wait_operation(op.name, 20).error is None
    task = op.target.tasks[0]
    assert task.retried == 1 and task.retries_charged == 0 and task.state is TaskState.SUCCEEDED
    assert (task.start_time - op.target.create_time).total_seconds() >= 0.3 * 2  # two delayed starts


def test_gpu_quota_holds_gpu_tasks_pending(backend, tmp_path):
    config = backend.registry.config
    config.policy.gpu_quota = 1
    config.images = ImageTable({"gpu": {"entrypoint": ["{python}", "-c", "import time; time.sleep(0.3)"]}}, tmp_path)
    backend.create_job("g1", make_job("gpu", gpu=True))
    backend.create_job("g2", make_job("gpu", gpu=True))
    first, second = backend.run_job(f"{PARENT}/jobs/g1"), backend.run_job(f"{PARENT}/jobs/g2")
    for op in (first, second):
        assert backend.wait_operation(op.name, 20).error is None
    runs = sorted((op.target.tasks[0].start_time, op.target.tasks[0].completion_time) for op in (first, second))
    assert runs[1][0] >= runs[0][1]  # never two GPU attempts at once


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_preemption_plan_arrivals_depend_on_the_seed_only():
    first = list(itertools.islice(PreemptionPlan(2.0, seed=7).arrival_offsets(), 200))
    again = list(itertools.islice(PreemptionPlan(2.0, seed=7, name_prefix="x").arrival_offsets(), 200))
    other = list(itertools.islice(PreemptionPlan(2.0, seed=8).arrival_offsets(), 200))
    assert first == again and first != other
    gaps = [b - a for a, b in zip([0.0] + first, first)]
    assert all(g > 0 for g in gaps) and 1.5 < sum(gaps) / len(gaps) < 2.5  # exponential, mean 2
    with pytest.raises(InvalidArgument, match="meanSeconds"):
        PreemptionPlan.from_json({"meanSeconds": 0})
    with pytest.raises(InvalidArgument, match="meanSeconds"):
        PreemptionPlan.from_json({"seed": 1})


def test_a_tiny_mean_does_not_make_the_schedule_spin(registry):
    """Over a fixed wait with nothing to preempt, the schedule's thread goes round its loop once
    per arrival, each a miss: with a mean of a microsecond it went round as fast as it could
    (tens of thousands of misses a second, one core busy); now at most once per minimum gap."""
    schedule = PreemptionSchedule(registry)
    started = time.monotonic()
    schedule.start(PreemptionPlan(1e-6, seed=1, name_prefix="projects/none/"))
    time.sleep(1.0)
    missed = schedule.stop()["missed"]
    elapsed = time.monotonic() - started
    assert 0 < missed <= elapsed / MIN_GAP_SECONDS + 1, (missed, elapsed)


def test_preemption_schedule_preempts_running_tasks_on_its_seeded_times(backend, registry, tmp_path):
    op = _slow(backend, tmp_path, "slow", task_count=2, max_retries=10)
    backend.create_job("spared", make_job("slow"))
    spared = backend.run_job(f"{PARENT}/jobs/spared")
    plan = PreemptionPlan(0.15, seed=3, grace_seconds=1.0, name_prefix=f"{PARENT}/jobs/slow/", max_preemptions=3)
    schedule = PreemptionSchedule(registry)
    schedule.start(plan)
    _wait_for(lambda: not schedule.status()["active"])
    status = schedule.status()
    assert len(status["preemptions"]) == 3 and status["plan"]["seed"] == 3
    # hits and misses together are the plan's first arrivals, in order; the last one was a hit
    offsets = [round(o, 3) for o in itertools.islice(plan.arrival_offsets(), 3 + status["missed"])]
    scheduled = [e["scheduledAtSeconds"] for e in status["preemptions"]]
    assert set(scheduled) <= set(offsets) and scheduled == sorted(scheduled) and scheduled[-1] == offsets[-1]
    assert all(e["atSeconds"] >= e["scheduledAtSeconds"] for e in status["preemptions"])
    assert all(e["task"].startswith(op.target.name) for e in status["preemptions"])
    _wait_for(lambda: sum(t.retried for t in op.target.tasks) == 3)  # each hit is a retried attempt
    assert spared.target.tasks[0].retried == 0  # outside namePrefix
    assert {t.last_result.status_code for t in op.target.tasks if t.retried} == {14}


def _all_processes_gone() -> bool:
    """No live attempt of the ``slow`` image among this process's children (the registry's
    attempts are; a session emulator subprocess may be too)."""
    import psutil

    def slow_attempt(proc) -> bool:
        try:
            return proc.status() != psutil.STATUS_ZOMBIE and "time.sleep(30)" in " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            return False

    return not any(slow_attempt(p) for p in psutil.Process().children(recursive=True))


def test_cancel_while_attempts_are_being_spawned(backend, tmp_path):
    backend.registry.config.policy.max_task_processes = 30
    op = _slow(backend, tmp_path, "slow", task_count=30, parallelism=30)
    _wait_for(lambda: op.target.tasks[-1].state is TaskState.RUNNING)  # all claimed in one step
    backend.cancel_execution(op.target.name)  # most are not spawned yet
    assert backend.wait_operation(op.name, 20).done and op.target.state is ExecutionState.CANCELLED
    assert op.target.to_proto().cancelled_count == 30
    _wait_for(_all_processes_gone)


def test_reset_while_attempts_are_being_spawned(registry, tmp_path):
    registry.config.policy.max_task_processes = 30
    op = _slow(registry.for_name(PARENT), tmp_path, "slow", task_count=30, parallelism=30)
    _wait_for(lambda: op.target.tasks[-1].state is TaskState.RUNNING)
    registry.reset()
    _wait_for(_all_processes_gone)


def test_a_failing_supervisor_kills_and_reaps_the_running_attempts_and_fails_the_execution(backend, tmp_path):
    """Task 0 runs; task 1 waits for a local process slot; then the image's entry turns into one
    no process can be started with (``Popen`` refuses an env name with ``=``) and a slot opens:
    the launch of task 1 raises in the supervisor, which kills and reaps task 0's process and
    ends the execution FAILED with the exception as the reason."""
    backend.registry.config.policy.max_task_processes = 1
    op = _slow(backend, tmp_path, "slow", task_count=2)
    _wait_for(lambda: 0 in backend.supervisors[op.target.name].running)
    pid = backend.supervisors[op.target.name].running[0].popen.pid
    backend.registry.config.images = ImageTable({"slow": {"entrypoint": ["/bin/true"], "env": {"A=B": "1"}}}, tmp_path)
    backend.registry.config.policy.max_task_processes = 2
    assert backend.wait_operation(op.name, 20).done
    execution = op.target
    assert execution.state is ExecutionState.FAILED and execution.failure_internal
    assert "ValueError: illegal environment variable name" in execution.failure_message
    assert [t.state for t in execution.tasks] == [TaskState.FAILED, TaskState.FAILED]
    assert op.error == (13, execution.failure_message)
    completed = execution.to_proto().conditions[-1]
    assert completed.reason == run_v2.Condition.CommonReason.INTERNAL and completed.message == execution.failure_message
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # killed and reaped: no longer this process's child
    assert backend.registry.config.slots.in_use == 0 and not backend.supervisors[op.target.name].running
    _wait_for(_all_processes_gone)

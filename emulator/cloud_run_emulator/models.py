"""Resource models of the emulated Cloud Run Admin API v2: Job, Execution, Task, Operation.

Each model keeps the emulator's own state and renders itself as the ``google.cloud.run_v2``
message (``to_proto``); counters and conditions are derived from task states at render time,
so rendering never changes state. Lifecycles are explicit Enums with allowed-transition tables;
:func:`transition` refuses anything else.

Not emulated: IAM, binary authorization, VPC access, encryption keys, secrets, probes and
``satisfiesPzs``; ``creator``/``lastModifier`` are a fixed placeholder principal.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import uuid
from typing import Optional

from google.cloud import run_v2
from google.longrunning import operations_pb2
from google.protobuf import any_pb2
from google.rpc import status_pb2

Cond = run_v2.Condition
PRINCIPAL = "emulator@localhost"
PREEMPTION_MESSAGE = (
    "Container instance preemption initiated by the platform due to underlying hardware maintenance."
)
EXIT_ERROR_MESSAGE = "The container exited with an error."


def copy_message(msg):
    """A deep copy of a proto-plus message (a job's spec, an execution's template)."""
    cls = type(msg)
    return cls.deserialize(cls.serialize(msg))


def utcnow() -> dt.datetime:
    """Current time, timezone-aware UTC."""
    return dt.datetime.now(dt.timezone.utc)


class TaskState(enum.Enum):
    """Lifecycle of one task (all of its attempts)."""

    PENDING = "PENDING"  # waiting for a slot, or for its next attempt
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class ExecutionState(enum.Enum):
    """Lifecycle of an execution."""

    RUNNING = "RUNNING"
    CANCELLING = "CANCELLING"
    FAILING = "FAILING"  # a task failed for good; others are being stopped
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TASK_TRANSITIONS = {
    TaskState.PENDING: {TaskState.RUNNING, TaskState.CANCELLED, TaskState.FAILED},
    TaskState.RUNNING: {TaskState.PENDING, TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED},
    TaskState.SUCCEEDED: set(),
    TaskState.FAILED: set(),
    TaskState.CANCELLED: set(),
}
EXECUTION_TRANSITIONS = {
    ExecutionState.RUNNING: {
        ExecutionState.CANCELLING, ExecutionState.FAILING, ExecutionState.SUCCEEDED,
        ExecutionState.FAILED, ExecutionState.CANCELLED,
    },
    ExecutionState.CANCELLING: {ExecutionState.CANCELLED, ExecutionState.FAILED},  # FAILED: its supervisor failed
    ExecutionState.FAILING: {ExecutionState.FAILED},
    ExecutionState.SUCCEEDED: set(),
    ExecutionState.FAILED: set(),
    ExecutionState.CANCELLED: set(),
}
TERMINAL_EXECUTION = {ExecutionState.SUCCEEDED, ExecutionState.FAILED, ExecutionState.CANCELLED}
TERMINAL_TASK = {TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED}


def transition(obj, new_state, table) -> None:
    """Move ``obj.state`` to ``new_state`` if the table allows it, else raise ``RuntimeError``."""
    if new_state not in table[obj.state]:
        raise RuntimeError(f"{obj.name}: illegal transition {obj.state.name} -> {new_state.name}")
    obj.state = new_state


@dataclasses.dataclass
class AttemptResult:
    """How one attempt ended: ``status_code`` 0 means success; ``exit_code`` xor ``term_signal``."""

    status_code: int
    message: str = ""
    exit_code: Optional[int] = None
    term_signal: Optional[int] = None

    def record(self, attempt: int, started: Optional[dt.datetime], ended: dt.datetime,
               stop_reason: Optional[str], log: str) -> dict:
        """This result as one entry of a task's attempt history (``/_emulator/attempts``)."""
        seconds = (ended - started).total_seconds() if started else 0.0
        return {"attempt": attempt, "startTime": started.isoformat() if started else None,
                "endTime": ended.isoformat(), "seconds": round(seconds, 3), "exitCode": self.exit_code,
                "termSignal": self.term_signal, "statusCode": self.status_code, "message": self.message,
                "stopReason": stop_reason, "log": log}

    def to_proto(self) -> run_v2.TaskAttemptResult:
        res = run_v2.TaskAttemptResult(status=status_pb2.Status(code=self.status_code, message=self.message))
        if self.term_signal is not None:
            res.term_signal = self.term_signal
        elif self.exit_code is not None:
            res.exit_code = self.exit_code
        return res


@dataclasses.dataclass
class Task:
    """One task of an execution.

    ``retried`` counts attempts after the first (it is ``CLOUD_RUN_TASK_ATTEMPT`` of the next
    one); ``retries_charged`` counts those charged against ``max_retries`` (a preemption may be
    free, see ``RuntimePolicy.preemption_consumes_retry``); ``not_before`` is the monotonic time
    the next attempt may start (start delay); ``history`` keeps every ended attempt (see
    :meth:`AttemptResult.record`).
    """

    name: str
    index: int
    job: str
    execution: str
    template: run_v2.TaskTemplate
    max_retries: int
    timeout_s: float
    create_time: dt.datetime
    log_uri: str
    uid: str = dataclasses.field(default_factory=lambda: str(uuid.uuid4()))
    state: TaskState = TaskState.PENDING
    retried: int = 0
    retries_charged: int = 0
    not_before: float = 0.0
    start_time: Optional[dt.datetime] = None
    completion_time: Optional[dt.datetime] = None
    last_result: Optional[AttemptResult] = None
    history: list = dataclasses.field(default_factory=list)  # one dict per ended attempt
    _rendered: tuple = dataclasses.field(default=(None, None), repr=False, compare=False)

    def to_proto(self) -> run_v2.Task:
        """The ``run_v2.Task``; re-rendered only when a field it shows has changed (a list of
        1,000 tasks is polled far more often than its tasks change). Treat it as read-only."""
        key = (self.state, self.retried, self.start_time, self.completion_time, self.last_result)
        if self._rendered[0] != key:
            self._rendered = (key, self._render())
        return self._rendered[1]

    def _render(self) -> run_v2.Task:
        t = self.template
        msg = run_v2.Task(
            name=self.name, uid=self.uid, generation=1, job=self.job, execution=self.execution,
            create_time=self.create_time, scheduled_time=self.create_time,
            update_time=self.completion_time or self.start_time or self.create_time,
            containers=list(t.containers), volumes=list(t.volumes), max_retries=self.max_retries,
            timeout=dt.timedelta(seconds=self.timeout_s), service_account=t.service_account,
            execution_environment=t.execution_environment, reconciling=self.state not in TERMINAL_TASK,
            observed_generation=1, index=self.index, retried=self.retried, log_uri=self.log_uri,
            node_selector=t.node_selector, conditions=self._conditions(), etag=f'"{self.uid[:8]}"',
        )
        if "gpu_zonal_redundancy_disabled" in t:
            msg.gpu_zonal_redundancy_disabled = t.gpu_zonal_redundancy_disabled
        for attr in ("start_time", "completion_time"):
            if getattr(self, attr):
                setattr(msg, attr, getattr(self, attr))
        if self.last_result is not None:
            msg.last_attempt_result = self.last_result.to_proto()
        return msg

    def _conditions(self) -> list:
        started = Cond.State.CONDITION_SUCCEEDED if self.start_time else Cond.State.CONDITION_PENDING
        completed = {
            TaskState.SUCCEEDED: Cond.State.CONDITION_SUCCEEDED,
            TaskState.FAILED: Cond.State.CONDITION_FAILED,
            TaskState.CANCELLED: Cond.State.CONDITION_FAILED,
            TaskState.RUNNING: Cond.State.CONDITION_RECONCILING,
        }.get(self.state, Cond.State.CONDITION_PENDING)
        when = self.completion_time or self.start_time or self.create_time
        done = Cond(type_="Completed", state=completed, last_transition_time=when)
        if self.state is TaskState.FAILED:
            done.execution_reason = Cond.ExecutionReason.NON_ZERO_EXIT_CODE
            done.message = self.last_result.message if self.last_result else "Task failed."
        elif self.state is TaskState.CANCELLED:
            done.execution_reason = Cond.ExecutionReason.CANCELLED
        return [Cond(type_="Started", state=started, last_transition_time=self.start_time or when), done]


@dataclasses.dataclass
class Execution:
    """One run of a job; owns its tasks. State changes only through the supervisor."""

    name: str
    job: str
    job_name: str
    template: run_v2.TaskTemplate
    task_count: int
    parallelism: int
    launch_stage: int
    labels: dict
    create_time: dt.datetime
    log_uri: str
    tasks: list = dataclasses.field(default_factory=list)
    uid: str = dataclasses.field(default_factory=lambda: str(uuid.uuid4()))
    state: ExecutionState = ExecutionState.RUNNING
    completion_time: Optional[dt.datetime] = None
    failure_message: str = ""
    failure_internal: bool = False  # failed by the emulator itself (its supervisor), not by a task
    deleted: bool = False

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_EXECUTION

    @property
    def etag(self) -> str:
        return f'"{self.uid[:8]}"'

    def count(self, state: TaskState) -> int:
        return sum(1 for t in self.tasks if t.state is state)

    def to_proto(self) -> run_v2.Execution:
        msg = run_v2.Execution(
            name=self.name, uid=self.uid, creator=PRINCIPAL, generation=1, labels=self.labels,
            create_time=self.create_time, start_time=self.create_time,
            update_time=self.completion_time or self.create_time, launch_stage=self.launch_stage,
            job=self.job, parallelism=self.parallelism, task_count=self.task_count, template=self.template,
            reconciling=not self.done, conditions=self._conditions(), observed_generation=1,
            running_count=self.count(TaskState.RUNNING), succeeded_count=self.count(TaskState.SUCCEEDED),
            failed_count=self.count(TaskState.FAILED), cancelled_count=self.count(TaskState.CANCELLED),
            retried_count=sum(1 for t in self.tasks if t.retried > 0), log_uri=self.log_uri,
            etag=self.etag,
        )
        if self.completion_time:
            msg.completion_time = self.completion_time
        return msg

    def _conditions(self) -> list:
        ok, t0 = Cond.State.CONDITION_SUCCEEDED, self.create_time
        completed = Cond(type_="Completed", last_transition_time=self.completion_time or t0)
        if self.state is ExecutionState.SUCCEEDED:
            completed.state = ok
            completed.message = f"Execution completed successfully; {self.task_count} task(s) succeeded."
        elif self.state is ExecutionState.FAILED:
            completed.state = Cond.State.CONDITION_FAILED
            if self.failure_internal:
                completed.reason = Cond.CommonReason.INTERNAL
            else:
                completed.execution_reason = Cond.ExecutionReason.NON_ZERO_EXIT_CODE
            completed.message = self.failure_message
        elif self.state is ExecutionState.CANCELLED:
            completed.state = Cond.State.CONDITION_FAILED
            completed.execution_reason = Cond.ExecutionReason.CANCELLED
            completed.message = "The execution was cancelled."
        elif self.state is ExecutionState.CANCELLING:
            completed.state = Cond.State.CONDITION_RECONCILING
            completed.execution_reason = Cond.ExecutionReason.CANCELLING
        else:
            completed.state = Cond.State.CONDITION_RECONCILING
        return [
            Cond(type_="ResourcesAvailable", state=ok, last_transition_time=t0),
            Cond(type_="Started", state=ok, last_transition_time=t0),
            completed,
        ]

    def reference(self) -> run_v2.ExecutionReference:
        """The job's ``latestCreatedExecution`` view of this execution."""
        status = {
            ExecutionState.SUCCEEDED: run_v2.ExecutionReference.CompletionStatus.EXECUTION_SUCCEEDED,
            ExecutionState.FAILED: run_v2.ExecutionReference.CompletionStatus.EXECUTION_FAILED,
            ExecutionState.CANCELLED: run_v2.ExecutionReference.CompletionStatus.EXECUTION_CANCELLED,
        }.get(self.state, run_v2.ExecutionReference.CompletionStatus.EXECUTION_RUNNING)
        ref = run_v2.ExecutionReference(name=self.name, create_time=self.create_time, completion_status=status)
        if self.completion_time:
            ref.completion_time = self.completion_time
        return ref


@dataclasses.dataclass
class Job:
    """A job: the user's spec plus server-side fields."""

    name: str
    spec: run_v2.Job
    launch_stage: int
    create_time: dt.datetime
    uid: str = dataclasses.field(default_factory=lambda: str(uuid.uuid4()))
    generation: int = 1
    update_time: Optional[dt.datetime] = None
    delete_time: Optional[dt.datetime] = None
    execution_count: int = 0
    latest: Optional[Execution] = None

    @property
    def etag(self) -> str:
        return f'"{self.uid[:8]}-{self.generation}"'

    def to_proto(self) -> run_v2.Job:
        msg = run_v2.Job(self.spec)
        msg.name, msg.uid, msg.generation, msg.observed_generation = self.name, self.uid, self.generation, self.generation
        msg.create_time, msg.update_time = self.create_time, self.update_time or self.create_time
        msg.creator = msg.last_modifier = PRINCIPAL
        msg.launch_stage, msg.execution_count, msg.reconciling, msg.etag = (
            self.launch_stage, self.execution_count, False, self.etag)
        msg.terminal_condition = Cond(
            type_="Ready", state=Cond.State.CONDITION_SUCCEEDED, last_transition_time=msg.update_time)
        if self.latest is not None:
            msg.latest_created_execution = self.latest.reference()
        if self.delete_time:
            msg.delete_time = self.delete_time
        return msg


@dataclasses.dataclass
class Operation:
    """A long-running operation whose metadata/response is a live view of ``target``.

    ``target`` is a :class:`Job` or :class:`Execution`; ``done`` and ``error`` are set by the
    backend or the execution supervisor, never by reading.
    """

    name: str
    target: object
    done: bool = False
    error: Optional[tuple] = None  # (grpc code, message)
    create_time: dt.datetime = dataclasses.field(default_factory=utcnow)

    def to_pb(self) -> operations_pb2.Operation:
        resource = self.target.to_proto()
        packed = any_pb2.Any()
        packed.Pack(type(resource).pb(resource))
        op = operations_pb2.Operation(name=self.name, done=self.done, metadata=packed)
        if self.done and self.error:
            op.error.CopyFrom(status_pb2.Status(code=self.error[0], message=self.error[1]))
        elif self.done:
            op.response.CopyFrom(packed)
        return op

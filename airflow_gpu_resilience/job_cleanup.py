"""When a teardown may delete a Cloud Run job: never under an execution that has not ended.

Deleting a job deletes its executions and their records (attempt history, exit codes). Cloud
Run's documentation does not say what it does with a job whose execution is still running, so the
teardown never asks: it deletes a job only when none of its executions is unended. An execution
just cancelled (a task marked failed in the UI cancels its execution, see the trigger) ends within
the task's grace period, so the teardown waits for it up to ``wait_seconds``; one still running
after that is left alone with the job, and the result says which. The local emulator refuses such
a delete with ``FAILED_PRECONDITION``.

The decision is a pure function (:func:`decide_job_cleanup`), the I/O is in
:meth:`~airflow_gpu_resilience.hooks.cloud_run.CloudRunGpuHook.delete_job_when_idle`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


class JobCleanupAction(str, enum.Enum):
    """What the teardown does with the job now; the values are what the cleanup task reports."""

    DELETE = "deleted"
    WAIT = "waiting"
    ABSENT = "absent"
    KEEP_NOT_OURS = "not ours, kept"
    KEEP_REQUESTED = "kept (keep_job)"
    KEEP_RUNNING = "kept: an execution is still running"


#: The actions that end the teardown's loop.
FINAL_ACTIONS = frozenset(set(JobCleanupAction) - {JobCleanupAction.WAIT})


def decide_job_cleanup(
    *,
    exists: bool,
    ours: bool,
    keep_job: bool,
    unended_executions: Sequence[str],
    waited_seconds: float,
    wait_seconds: float,
) -> JobCleanupAction:
    """Decide what a teardown does with a Cloud Run job.

    The rules, in order: a missing job is ``ABSENT``; a job without the provider's label
    (``managed-by=airflow-gpu-resilience``) is someone else's, ``KEEP_NOT_OURS``; ``keep_job``
    keeps it (``KEEP_REQUESTED``); a job with no unended execution is deleted (``DELETE``); with
    one, the teardown waits (``WAIT``) until ``waited_seconds`` reaches ``wait_seconds``, then
    keeps the job (``KEEP_RUNNING``).

    :param exists: whether GetJob found the job.
    :param ours: whether the job carries the provider's label (ignored when it does not exist).
    :param keep_job: the user asked to keep the job.
    :param unended_executions: names of the job's executions without a completion time.
    :param waited_seconds: seconds the teardown has waited so far (>= 0).
    :param wait_seconds: the most seconds it waits for executions to end (>= 0).
    :return: the action.
    :raises ValueError: ``waited_seconds`` or ``wait_seconds`` is negative.
    """
    if waited_seconds < 0 or wait_seconds < 0:
        raise ValueError(f"waited_seconds ({waited_seconds}) and wait_seconds ({wait_seconds}) must be >= 0")
    if not exists:
        return JobCleanupAction.ABSENT
    if not ours:
        return JobCleanupAction.KEEP_NOT_OURS
    if keep_job:
        return JobCleanupAction.KEEP_REQUESTED
    if not unended_executions:
        return JobCleanupAction.DELETE
    if waited_seconds < wait_seconds:
        return JobCleanupAction.WAIT
    return JobCleanupAction.KEEP_RUNNING


@dataclass(frozen=True)
class JobCleanupResult:
    """What the teardown did with a job.

    :param job_name: the job id.
    :param action: the final action (never ``WAIT``).
    :param unended_executions: the executions still running when it decided (``KEEP_RUNNING``),
        else empty.
    :param waited_seconds: seconds spent waiting for executions to end.
    """

    job_name: str
    action: JobCleanupAction
    unended_executions: tuple[str, ...] = field(default_factory=tuple)
    waited_seconds: float = 0.0

    def to_dict(self) -> dict:
        """:return: a JSON-serializable form (for an XCom)."""
        return {"job_name": self.job_name, "action": self.action.value,
                "unended_executions": list(self.unended_executions), "waited_seconds": round(self.waited_seconds, 1)}

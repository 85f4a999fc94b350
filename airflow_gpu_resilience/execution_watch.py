"""Waiting for an execution to finish, as pure logic: one :meth:`ExecutionWatch.step` per poll.

No I/O and no clock of its own: the hook's blocking wait and the triggers' shared watcher fetch
the execution and its tasks and pass them in, with the time.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from google.cloud import run_v2

from airflow_gpu_resilience.attempt_log import AttemptLog
from airflow_gpu_resilience.outcome import ExecutionState, execution_state

__all__ = ["ExecutionWatch", "PollState", "PollStep"]

class PollState(str, enum.Enum):
    """What a wait does after one poll (:meth:`ExecutionWatch.step`)."""

    WAIT = "wait"
    """Still running: sleep :attr:`PollStep.sleep_seconds`, then poll again."""
    FINISHED = "finished"
    """The execution has finished."""
    TIMED_OUT = "timed_out"
    """The wait's timeout passed while the execution was still running."""


@dataclass(frozen=True)
class PollStep:
    """The result of one poll: :attr:`state`, and for ``WAIT`` the seconds to sleep (never past the deadline)."""

    state: PollState
    sleep_seconds: float = 0.0


@dataclass
class ExecutionWatch:
    """The pure part of waiting for an execution to finish: one :meth:`step` per poll, no I/O.

    The hook's blocking :meth:`CloudRunGpuHook.wait_for_execution` and the triggers' shared
    watcher (:mod:`~airflow_gpu_resilience.triggers.execution_watcher`, one per watched
    execution, without a timeout) share it: each fetches the execution and its tasks, passes them
    to :meth:`step` (``None`` after a transient API error) and waits as it says. The clock is
    passed in.

    :param poll_interval: seconds between polls (> 0).
    :param timeout: seconds to wait in total, or ``None`` to wait forever.
    :param started: ``time.monotonic()`` when the wait began.
    :param attempts: where the finished attempts seen are recorded (default: a new log).
    """

    poll_interval: float
    timeout: float | None
    started: float
    attempts: AttemptLog = field(default_factory=AttemptLog)

    @property
    def deadline(self) -> float | None:
        """``time.monotonic()`` value when the wait times out, or ``None``."""
        return None if self.timeout is None else self.started + self.timeout

    def step(self, execution: run_v2.Execution | None, tasks: Sequence[run_v2.Task], now: float) -> PollStep:
        """Record the poll's attempts and say what to do next.

        :param execution: the execution as just fetched, or ``None`` if the poll failed transiently.
        :param tasks: its tasks (may be empty when the caller does not track attempts).
        :param now: ``time.monotonic()`` after the poll.
        :return: ``FINISHED`` when the execution is no longer running; else ``TIMED_OUT`` once
            the deadline has passed, else ``WAIT`` with the sleep until the next poll.
        """
        if execution is not None:
            self.attempts.observe(tasks)
            if execution_state(execution) is not ExecutionState.RUNNING:
                return PollStep(PollState.FINISHED)
        deadline = self.deadline
        if deadline is not None and now >= deadline:
            return PollStep(PollState.TIMED_OUT)
        sleep = self.poll_interval if deadline is None else min(self.poll_interval, deadline - now)
        return PollStep(PollState.WAIT, sleep)

"""The per-execution supervisor thread: the only writer of an execution's state once created.

Loop (under the backend's lock): reap finished attempts, enforce timeouts and SIGKILL
deadlines, stop work when cancelling or failing, claim pending tasks up to ``parallelism``, the
GPU quota and the free local process slots (:class:`~.runtime.ProcessSlots`, shared by every
execution), and finish the execution when nothing runs any more. The claimed attempts'
processes are then spawned *outside* the lock (a fork-exec costs milliseconds, and a step may
start dozens), and registered under it again. Between steps the thread waits until an attempt's
process exits or ``poll_seconds`` pass. HTTP handlers only read, or post requests (cancel,
preempt) that this loop carries out. Memory per execution is its task records; threads and
processes are bounded by executions and slots, not by ``taskCount``.

Should the loop raise (an emulator bug, or an image table entry no process can be started
with), the execution does not stay RUNNING: every attempt's process group is killed and reaped,
running tasks fail and pending ones are cancelled, and the execution ends FAILED with the
exception in its ``Completed`` condition (reason ``INTERNAL``).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from typing import Callable

from .models import (
    Execution, ExecutionState, TaskState, EXECUTION_TRANSITIONS, TASK_TRANSITIONS, TERMINAL_TASK, AttemptResult,
    transition, utcnow,
)
from .runtime import Attempt, RuntimeConfig, gcs_buckets, launch, uses_gpu, wait_for_exit

logger = logging.getLogger(__name__)
#: ``status.code`` of an attempt that was running when its supervisor failed (INTERNAL).
INTERNAL = 13


class ExecutionSupervisor(threading.Thread):
    """Runs one execution's tasks to completion.

    :param execution: the execution to run (its tasks are PENDING).
    :param config: runtime settings.
    :param cond: the backend's ``threading.Condition``; held for every state change and
        notified after each, so ``WaitOperation`` can block on it.
    :param on_finish: called under ``cond`` once the execution is terminal (more callbacks
        can be appended to ``finish_callbacks``).
    :param gpu_slots_left: ``callable() -> int``, GPU attempts that may still start in this
        location (only asked when the execution uses a GPU).
    """

    def __init__(self, execution: Execution, config: RuntimeConfig, cond: threading.Condition,
                 on_finish: Callable[[Execution], None], gpu_slots_left: Callable[[], int]) -> None:
        super().__init__(name=f"supervisor-{execution.name.rsplit('/', 1)[-1]}", daemon=True)
        self.execution = execution
        self.config = config
        self.cond = cond
        self.finish_callbacks = [on_finish]
        self.gpu = uses_gpu(execution.template)
        self._gpu_slots_left = gpu_slots_left
        self.running: dict = {}  # task index -> Attempt
        self.starting: dict = {}  # task index -> attempt number, claimed but not yet spawned
        self._shutdown = False
        self._first_pending = 0  # no task below this index is PENDING

    # --- requests from other threads (caller holds cond) -------------------------------
    def request_cancel(self) -> None:
        """Ask for cancellation; the loop stops running attempts and cancels the rest. An
        execution already failing (a task failed for good) stays on course to FAILED."""
        if self.execution.state is ExecutionState.RUNNING:
            transition(self.execution, ExecutionState.CANCELLING, EXECUTION_TRANSITIONS)

    def preempt(self, index: int, grace: float) -> Attempt:
        """Start a maintenance preemption of task ``index``'s running attempt."""
        attempt = self.running[index]
        attempt.stop("preempted", grace)
        return attempt

    def terminate(self) -> None:
        """End the loop and SIGTERM every running attempt's process group (shutdown, reset)."""
        self._shutdown = True
        for attempt in self.running.values():
            attempt.signal_group(signal.SIGTERM)

    def reap(self, deadline: float) -> None:
        """After :meth:`terminate`: wait until ``deadline`` (monotonic), SIGKILL the rest, reap."""
        for attempt in self.running.values():
            try:
                attempt.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            attempt.signal_group(signal.SIGKILL)
            attempt.popen.wait()
            attempt.close()
        self.config.slots.give(len(self.running))
        self.running.clear()

    # --- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # never leave the execution RUNNING with nobody to finish it
            logger.exception("the supervisor of %s failed", self.execution.name)
            self._abort(f"The emulator failed to run this execution: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        while True:
            with self.cond:
                if self._shutdown:
                    if not self.running:  # stay alive until reaped: children die with this thread
                        return
                    self.cond.wait(self.config.policy.poll_seconds)
                    continue
                changed = self._step()
                if changed:
                    self.cond.notify_all()
                if self.execution.done:
                    return
                claimed = [(self._task(i), n) for i, n in self.starting.items()]
                running = list(self.running.values())
            if claimed:
                self._spawn(claimed)
            else:
                wait_for_exit(running, self.config.policy.poll_seconds)

    def _task(self, index: int):
        return self.execution.tasks[index]

    def _spawn(self, claimed: list) -> None:
        """Start the claimed attempts' processes without the lock, then register them (also
        those started before a launch raised something unexpected, which then propagates)."""
        outcomes = []
        try:
            for task, number in claimed:
                try:
                    outcomes.append((task, launch(task, number, self.execution.task_count, self.config)))
                except (LookupError, OSError) as exc:
                    outcomes.append((task, exc))
        finally:
            with self.cond:
                for task, outcome in outcomes:
                    del self.starting[task.index]
                    self._register(task, outcome)
                self.cond.notify_all()

    def _register(self, task, outcome) -> None:
        """Record a spawned attempt (stopped at once if the execution is winding down or the
        emulator shutting down meanwhile), or the failure to spawn it."""
        if isinstance(outcome, (LookupError, OSError)):
            self.config.slots.give()
            retryable = isinstance(outcome, OSError)  # an image not in the table is not retryable
            task.last_result = (AttemptResult(2, f"The container failed to start: {outcome}", exit_code=127)
                                if retryable else AttemptResult(5, str(outcome)))
            task.history.append(task.last_result.record(task.retried, None, utcnow(), None, ""))
            self._fail_attempt(task, task.last_result, retryable=retryable)
        elif self._shutdown:  # terminate() and reap() have run already: nobody else will reap it
            outcome.signal_group(signal.SIGKILL)
            outcome.popen.wait()
            outcome.close()
            self.config.slots.give()
        else:
            # The task's start_time (the API's, for its latest attempt) is its process's start,
            # the same instant the attempt record starts at, so both read one clock.
            task.start_time = outcome.started
            self.running[task.index] = outcome
            if self.execution.state in (ExecutionState.CANCELLING, ExecutionState.FAILING):
                outcome.stop("cancelled", self.config.policy.grace_seconds)

    def _step(self) -> bool:
        changed = self._reap()
        self._enforce_deadlines()
        if self.execution.state in (ExecutionState.CANCELLING, ExecutionState.FAILING):
            changed |= self._wind_down()
        else:
            changed |= self._start_pending()
        if not self.running and not self.starting and all(t.state in TERMINAL_TASK for t in self.execution.tasks):
            self._finish()
            changed = True
        return changed

    def _reap(self) -> bool:
        finished = [(i, a, a.popen.poll()) for i, a in self.running.items()]
        finished = [f for f in finished if f[2] is not None]
        for index, attempt, returncode in finished:
            del self.running[index]
            attempt.signal_group(signal.SIGKILL)  # stragglers in the group, like a container stop
            attempt.close()
            self.config.slots.give()
            self._record(attempt, attempt.result(returncode))
        if finished:
            self._sync_gcs()
        return bool(finished)

    def _sync_gcs(self) -> None:
        """Index files written through the mounts (after attempts and at the end; the GCS
        emulator also re-indexes before each request)."""
        buckets = gcs_buckets(self.execution.template)
        if buckets:
            self.config.gcs.reconcile(buckets)

    def _record(self, attempt: Attempt, result: AttemptResult) -> None:
        task = attempt.task
        task.last_result = result
        task.history.append(result.record(attempt.number, attempt.started, utcnow(), attempt.stop_reason,
                                          attempt.log_path.name))
        if result.status_code == 0:
            self._end_task(task, TaskState.SUCCEEDED)
        elif attempt.stop_reason == "cancelled":
            self._end_task(task, TaskState.CANCELLED)
        else:
            free = attempt.stop_reason == "preempted" and not self.config.policy.preemption_consumes_retry
            self._fail_attempt(task, result, charge=not free)

    def _fail_attempt(self, task, result: AttemptResult, retryable: bool = True, charge: bool = True) -> None:
        """A failed attempt: retry the task while its budget lasts, else fail it (and with it
        the execution). ``charge=False`` retries without using up ``maxRetries``."""
        budget_left = task.retries_charged < task.max_retries or not charge
        if retryable and budget_left and self.execution.state is ExecutionState.RUNNING:
            task.retried += 1
            task.retries_charged += int(charge)
            task.not_before = time.monotonic() + self.config.policy.start_delay_seconds
            transition(task, TaskState.PENDING, TASK_TRANSITIONS)
            self._first_pending = min(self._first_pending, task.index)
            return
        self._end_task(task, TaskState.FAILED)
        if self.execution.state is ExecutionState.RUNNING:
            short = task.name.rsplit("/", 1)[-1]
            self.execution.failure_message = f"Task {short} failed with message: {result.message}"
            transition(self.execution, ExecutionState.FAILING, EXECUTION_TRANSITIONS)

    def _end_task(self, task, state: TaskState) -> None:
        transition(task, state, TASK_TRANSITIONS)
        task.completion_time = utcnow()

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for attempt in self.running.values():
            if attempt.stop_reason is None and now >= attempt.deadline:
                attempt.stop("timeout", self.config.policy.grace_seconds)
            elif attempt.kill_at is not None and now >= attempt.kill_at:
                attempt.signal_group(signal.SIGKILL)
                attempt.kill_at = None

    def _wind_down(self) -> bool:
        """Cancel pending tasks and stop running attempts (cancel, or after a final failure)."""
        changed = False
        for task in self.execution.tasks:
            if task.state is TaskState.PENDING:
                self._end_task(task, TaskState.CANCELLED)
                changed = True
        for attempt in self.running.values():
            if attempt.stop_reason is None:
                attempt.stop("cancelled", self.config.policy.grace_seconds)
            else:
                attempt.stop_reason = "cancelled"  # a stop already under way now ends as cancel
        return changed

    def _start_pending(self) -> bool:
        """Claim pending tasks, lowest index first, up to ``parallelism``, the free local process
        slots and the GPU quota: RUNNING, a slot taken, to be spawned."""
        free = min((self.execution.parallelism or self.execution.task_count) - len(self.running) - len(self.starting),
                   self.config.slots.free(self.config.policy.max_task_processes))
        if self.gpu and free > 0:
            free = min(free, self._gpu_slots_left())
        tasks, now, changed = self.execution.tasks, time.monotonic(), False
        while self._first_pending < len(tasks) and tasks[self._first_pending].state is not TaskState.PENDING:
            self._first_pending += 1  # finished tasks are not looked at again (10,000 of them)
        for index in range(self._first_pending, len(tasks)):
            if free <= 0:
                break
            task = tasks[index]
            if task.state is TaskState.PENDING and now >= task.not_before:
                transition(task, TaskState.RUNNING, TASK_TRANSITIONS)
                task.start_time = utcnow()
                self.starting[task.index] = task.retried
                self.config.slots.take()
                free -= 1
                changed = True
        return changed

    def _finish(self) -> None:
        ex = self.execution
        final = {
            ExecutionState.RUNNING: ExecutionState.SUCCEEDED,
            ExecutionState.FAILING: ExecutionState.FAILED,
            ExecutionState.CANCELLING: ExecutionState.CANCELLED,
        }[ex.state]
        transition(ex, final, EXECUTION_TRANSITIONS)
        self._complete()

    def _complete(self) -> None:
        """The execution has ended: its completion time, the buckets indexed, the callbacks run
        (also when indexing fails, so that its operation is done all the same)."""
        self.execution.completion_time = utcnow()
        try:
            self._sync_gcs()
        finally:
            for callback in self.finish_callbacks:
                callback(self.execution)

    # --- after a failure of the loop -----------------------------------------------------
    def _abort(self, reason: str) -> None:
        """Kill and reap every attempt, fail the running tasks and cancel the pending ones with
        ``reason``, and end the execution FAILED with it (unless it has ended already)."""
        with self.cond:
            attempts = list(self.running.values())
            self.running.clear()  # shutdown's reap() must not wait for (or give back) these too
            self.config.slots.give(len(attempts) + len(self.starting))
            self.starting.clear()
            for attempt in attempts:
                attempt.signal_group(signal.SIGKILL)
        for attempt in attempts:  # outside the lock: a process in the kernel may take a moment to die
            attempt.popen.wait()
            attempt.close()
        with self.cond:
            result = AttemptResult(INTERNAL, reason)
            for task in self.execution.tasks:
                if task.state is TaskState.RUNNING:
                    task.last_result = result
                    task.history.append(result.record(task.retried, None, utcnow(), None, ""))
                    self._end_task(task, TaskState.FAILED)
                elif task.state is TaskState.PENDING:
                    self._end_task(task, TaskState.CANCELLED)
            if not self.execution.done:
                self.execution.failure_message, self.execution.failure_internal = reason, True
                transition(self.execution, ExecutionState.FAILED, EXECUTION_TRANSITIONS)
                try:
                    self._complete()
                except Exception:  # the execution has ended all the same
                    logger.exception("finishing %s after its supervisor failed", self.execution.name)
            self.cond.notify_all()

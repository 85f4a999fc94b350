"""Preemption notice: SIGTERM/SIGINT handling, the attempt deadline and the stop decision.

The signal handler only records the time, sets a flag and writes a byte to a pipe; it takes no lock (it runs on
the main thread between two bytecodes, and one that took a lock the main thread held there, as
``threading.Event.set`` does, would wait for it forever). Every way in checks :attr:`PreemptionWatcher.requested`
at every step boundary and asks :func:`decide_stop`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import select
import signal
import sys
import threading
import time
from types import FrameType
from typing import Callable

DEFAULT_GRACE_SECONDS = 10.0
#: ``preemption_save`` choices: save at the stop only when it fits in the grace period (``deadline``, the
#: default), always (the common recipe), or never.
PREEMPTION_SAVES = ("deadline", "always", "never")
#: :func:`decide_stop`'s answers: go on training, save the step then exit, exit without saving.
CONTINUE, SAVE, EXIT = "continue", "save", "exit"
#: A save fits when its estimate times this factor, plus :data:`SAVE_MARGIN_SECONDS`, is below the grace left:
#: a save after SIGTERM competes with the rest of the shutdown for the machine.
SAVE_ESTIMATE_FACTOR = 1.5
#: Seconds added to a save's estimate before comparing it with the time left.
SAVE_MARGIN_SECONDS = 0.5
#: :func:`decide_stop`'s reason when a save would not fit in the grace left.
NO_TIME_TO_SAVE = "final checkpoint skipped: it would not fit in the grace period"


def process_age_seconds() -> float:
    """Cloud Run's task timeout counts from the container's start, when its process (the exec-form entrypoint)
    started, not from a watcher made after the imports, the data download and the model build.

    :return: seconds since this process started (Linux ``/proc``, to 10 ms), else 0."""
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as handle:
            uptime = float(handle.read().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class PreemptionWatcher:
    """Turns SIGTERM/SIGINT (and an optional deadline) into a stop request.

    :param grace_seconds: time between SIGTERM and SIGKILL, in seconds; default 10.
    :param deadline: monotonic time (seconds) at which to stop as if preempted; default none. Set ``timeout_at``
        too (the monotonic time the task timeout kills the attempt), so that the time left after a deadline stop
        is counted to it, not by the grace.
    :param signals: the signals to handle; default SIGTERM and SIGINT.
    :param clock: monotonic clock in seconds.

    ``started_at``, from which :func:`set_task_deadline` counts the task timeout, is the process's start (on
    :func:`time.monotonic`'s scale), not the watcher's creation."""

    def __init__(self, grace_seconds: float = DEFAULT_GRACE_SECONDS, *, deadline: float | None = None,
                 signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_seconds, self.deadline = grace_seconds, deadline
        self.timeout_at: float | None = None
        self._signals, self._clock, self._requested = signals, clock, False
        self._wake: tuple[int, int] | None = None  # the pipe the handler writes to, while installed
        self._previous: dict[signal.Signals, object] = {}
        self.started_at = clock() - (process_age_seconds() if clock is time.monotonic else 0.0)
        self.received_at: float | None = None
        self.signal_name: str | None = None

    def __enter__(self) -> PreemptionWatcher:
        self.install()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.uninstall()

    def install(self) -> None:
        """Install the handlers (main thread only), remembering the previous ones."""
        if self._wake is None:
            self._wake = os.pipe()
            os.set_blocking(self._wake[1], False)
        for signum in self._signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        """Restore the handlers that were there before :meth:`install`."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # no lock may be taken here (see the module docstring): a flag, and a byte that wakes wait()
        if self.received_at is None:
            self.received_at = self._clock()
            self.signal_name = signal.Signals(signum).name
        self._requested = True
        if self._wake is not None:
            try:
                os.write(self._wake[1], b"\0")
            except OSError:  # the pipe is full: wake-ups are pending already
                pass

    @property
    def requested(self) -> bool:
        """Whether a signal arrived or the deadline passed."""
        if not self._requested and self.deadline is not None and self._clock() >= self.deadline:
            self.received_at, self.signal_name = self._clock(), "DEADLINE"
            self._requested = True
        return self._requested

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, waking early on a signal (the handler's byte, never read, keeps later waits short).

        :return: whether a stop was requested."""
        if seconds > 0 and not self.requested:
            if self._wake is None:
                time.sleep(seconds)
            else:
                select.select([self._wake[0]], [], [], seconds)
        return self.requested

    def remaining_grace(self) -> float:
        """:return: seconds left before the expected SIGKILL (the full grace before a notice)."""
        if self.received_at is None:
            return self.grace_seconds
        if self.signal_name == "DEADLINE" and self.timeout_at is not None:
            return self.timeout_at - self._clock()
        return self.grace_seconds - (self._clock() - self.received_at)


def save_fits(estimated_save_seconds: float, remaining_seconds: float, margin: float = SAVE_MARGIN_SECONDS) -> bool:
    """Whether a save fits in the time left (all in seconds).

    :return: ``estimated_save_seconds`` x :data:`SAVE_ESTIMATE_FACTOR` + ``margin`` < ``remaining_seconds``."""
    return estimated_save_seconds * SAVE_ESTIMATE_FACTOR + margin < remaining_seconds


@dataclasses.dataclass(frozen=True)
class StopDecision:
    """What to do at a step boundary, and why.

    :param action: :data:`CONTINUE`, :data:`SAVE` (save the step, then exit 143) or :data:`EXIT` (exit 143 with
        the last committed checkpoint in force).
    :param reason: the why, in words, as the drivers log it."""

    action: str
    reason: str


def decide_stop(*, requested: bool, step: int, last_committed: int | None, estimated_save_seconds: float,
                remaining_grace: float, mode: str = "deadline", step_torn: bool = False,
                save_abandoned: bool = False, checkpointing: bool = True) -> StopDecision:
    """The one stop decision after SIGTERM/SIGINT or the task deadline (pure; table-tested).

    In this order: no stop requested -> continue; the save in flight was abandoned (no time left), the step was torn
    by the stop (the state may hold part of it), checkpointing is off, or ``step`` is committed already or is 0 ->
    exit; ``mode`` ``never`` -> exit, ``always`` -> save; else (``deadline``) save when :func:`save_fits`, exit if not.

    :param requested: whether a stop was requested.
    :param step: steps done (the step a save would write).
    :param last_committed: the newest committed step of this attempt, or ``None``.
    :param estimated_save_seconds: a synchronous save's expected duration, seconds.
    :param remaining_grace: seconds left before the expected SIGKILL.
    :param mode: one of :data:`PREEMPTION_SAVES`; default ``deadline``.
    :param step_torn: the step after ``step`` raised midway after the stop request.
    :param save_abandoned: the background save in flight was abandoned for want of time.
    :param checkpointing: whether this run writes checkpoints at all.
    :return: the decision.
    :raises ValueError: ``mode`` not in :data:`PREEMPTION_SAVES`."""
    if mode not in PREEMPTION_SAVES:
        raise ValueError(f"preemption_save must be one of {PREEMPTION_SAVES}, got {mode!r}")
    if not requested:
        return StopDecision(CONTINUE, "no stop requested")
    exits = (
        (save_abandoned, "no checkpoint at the stop: the save in flight was abandoned, no time left"),
        (step_torn, "no checkpoint at the stop: the interrupted step may have changed the state"),
        (not checkpointing, "no checkpoint at the stop (checkpointing off)"),
        (last_committed == step or step == 0, "nothing new to checkpoint"),
        (mode == "never", "no checkpoint at the stop (preemption_save never)"))
    for applies, reason in exits:
        if applies:
            return StopDecision(EXIT, reason)
    if mode == "always":
        return StopDecision(SAVE, "saving at the stop (preemption_save always)")
    if save_fits(estimated_save_seconds, remaining_grace):
        return StopDecision(SAVE, "saving at the stop: it fits in the grace period")
    return StopDecision(EXIT, NO_TIME_TO_SAVE)


def ignore_termination_signals(worker_id: int | None = None) -> None:
    """Make this process ignore SIGTERM and SIGINT from anyone but its parent (a DataLoader ``worker_init_fn``).

    Cloud Run signals the whole process group (why that matters: ``docs/your-code.rst``, "Process groups"). A
    SIGTERM from the parent still ends this process at once (exit 0): ``multiprocessing`` terminates its daemonic
    children so at interpreter exit, and joins them. On Linux (``signal.sigwaitinfo``) both signals are blocked
    and a daemon thread waits for them and reads their sender; elsewhere they are simply ignored.

    :param worker_id: the DataLoader worker index (unused)."""
    if not hasattr(signal, "sigwaitinfo"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return
    parent = os.getppid()
    wanted = {signal.SIGTERM, signal.SIGINT}
    for signum in wanted:  # a no-op if one is ever delivered to a thread not blocking it
        signal.signal(signum, lambda *_: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)  # threads started later inherit the mask
    threading.Thread(target=_exit_on_parent_signal, args=(parent, wanted),
                     name="termination-signals", daemon=True).start()


def _exit_on_parent_signal(parent: int, signals: set[signal.Signals]) -> None:
    while True:
        info = signal.sigwaitinfo(signals)
        if info.si_pid == parent and info.si_signo == signal.SIGTERM:
            os._exit(0)  # the parent's terminate() at its exit: end now, cleanly


def set_task_deadline(watcher: PreemptionWatcher, task_timeout_seconds: float | None,
                      grace_seconds: float | None = None) -> None:
    """Make ``watcher`` stop the attempt before Cloud Run's task timeout kills it.

    The timeout counts from ``watcher.started_at`` (the process's start, as Cloud Run's counts from the
    container's); the stop comes ``min(grace, timeout / 2)`` seconds before it, and the time left after that stop
    is counted to the timeout (so a final save is made only when it fits before the kill).

    :param watcher: the watcher to configure.
    :param task_timeout_seconds: the attempt's timeout (``TASK_TIMEOUT_SECONDS``), in seconds, > 0; ``None`` for no
        deadline.
    :param grace_seconds: the margin's upper bound; default ``watcher.grace_seconds``.
    :raises ValueError: a timeout that is not a finite number > 0."""
    if task_timeout_seconds is None:
        watcher.deadline = watcher.timeout_at = None
        return
    if not (isinstance(task_timeout_seconds, (int, float)) and math.isfinite(task_timeout_seconds)
            and task_timeout_seconds > 0):
        raise ValueError(f"task_timeout_seconds must be a finite number > 0, got {task_timeout_seconds!r}")
    grace = watcher.grace_seconds if grace_seconds is None else grace_seconds
    watcher.timeout_at = watcher.started_at + task_timeout_seconds
    watcher.deadline = watcher.timeout_at - min(grace, task_timeout_seconds / 2)


def exit_now(code: int) -> None:
    """Flush stdout and stderr and end the process with ``code`` at once (``os._exit``).

    Everything the loop keeps is fsynced before :meth:`ResilientLoop.run` returns; skipping the interpreter's
    teardown (seconds with torch loaded) keeps the exit inside the grace period.

    :param code: the exit status, e.g. what :meth:`ResilientLoop.run` returned."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)

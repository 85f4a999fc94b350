"""The commit protocol for checkpoints that a training framework writes itself.

``transformers.Trainer`` writes ``checkpoint-<step>/`` folders and Lightning ``.ckpt`` files; neither marks a
finished checkpoint. :class:`ArtifactCheckpoints` is the :class:`~gpu_resilience_worker.commit.CommitStore` of such
a folder (:meth:`~ArtifactCheckpoints.begin_save` before the framework writes, :meth:`~ArtifactCheckpoints.commit`
after), with the stop decision of :mod:`gpu_resilience_worker.preemption` and the attempt's record
(:class:`~gpu_resilience_worker.attempt.Attempt`), so a framework's folder holds the same files as the bundled
worker's. Local (or FUSE-mounted) paths only: the frameworks write with ``open``/``os`` themselves."""

from __future__ import annotations

import os
import time
from typing import Callable

from gpu_resilience_worker.attempt import Attempt
from gpu_resilience_worker.commit import CommitStore
from gpu_resilience_worker.config import StopTiming
from gpu_resilience_worker.errors import EXIT_OK, EXIT_PREEMPTED, ConfigError, NewerCheckpointError, check_number
from gpu_resilience_worker.fatal import write_fatal
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.policies import KeepLatestN, SaveStats
from gpu_resilience_worker.preemption import CONTINUE, EXIT, NO_TIME_TO_SAVE, PreemptionWatcher, decide_stop
from gpu_resilience_worker.state import settle_vector_math
from gpu_resilience_worker.storage import LocalStorage
from gpu_resilience_worker.task_folder import CommitRecord, Naming


class ArtifactCheckpoints(CommitStore):
    """Commit records, retention and the SIGTERM stop decision for a framework's own checkpoints.

    :param folder: where the framework writes its checkpoints (a local path).
    :param prefix: the artifact name before the step, e.g. ``"checkpoint-"``.
    :param suffix: the artifact name after the step, e.g. ``".ckpt"``; default none.
    :param keep_latest_k: committed artifacts to keep (>= 2); default 2.
    :param grace_seconds: SIGTERM to SIGKILL, in seconds; default ``PREEMPTION_GRACE_SECONDS`` or 10.
        The attempt's deadline is ``TASK_TIMEOUT_SECONDS``'s (:class:`~gpu_resilience_worker.config.StopTiming`).
    :param logger: structured logger; default one on stdout.
    :param clock: monotonic clock in seconds (save durations).
    :raises ValueError: for an empty folder, a prefix or suffix with other characters than letters, digits and
        ``._=-`` (or an empty prefix), ``keep_latest_k`` < 2 or ``grace_seconds`` < 0.
    :raises SystemExit: 78 (``FATAL`` written) for a malformed ``PREEMPTION_GRACE_SECONDS`` or ``TASK_TIMEOUT_SECONDS``."""

    def __init__(self, folder: str, *, prefix: str, suffix: str = "", keep_latest_k: int = 2,
                 grace_seconds: float | None = None, logger: StructuredLogger | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(folder, (str, os.PathLike)) or not str(folder):
            raise ValueError(f"folder must be a non-empty path, got {folder!r}")
        naming = Naming.folder_shape(prefix, suffix)
        check_number("keep_latest_k", keep_latest_k, minimum=2, integer=True)  # the newest may be in flight
        StopTiming.check(grace_seconds)
        settle_vector_math()  # before the framework's first step
        self.log = logger or StructuredLogger()
        super().__init__(os.path.abspath(os.fspath(folder)), LocalStorage(), self.log, naming)
        self.keep = KeepLatestN(keep_latest_k)
        self.watcher = PreemptionWatcher()
        try:
            StopTiming.from_env(grace_seconds=grace_seconds).apply(self.watcher)
        except ConfigError as exc:  # the deployment's environment: non-retryable, as on every other way in
            raise SystemExit(write_fatal(self.folder, exc, self.log)) from None
        self.stats, self._clock = SaveStats(), clock
        self.last_committed: int | None = None
        self._save_started: dict[int, float] = {}
        #: This attempt's account in the folder, from :meth:`begin_attempt` (the writer only).
        self.attempt: Attempt | None = None
        self._restore_started: float | None = None

    # the protocol ----------------------------------------------------------------------------
    def begin_save(self, step: int) -> None:
        """Call before the framework writes ``step``: remove its stale record, then its stale artifact; start the clock.

        :param step: the step about to be written (>= 0)."""
        self.begin(step)
        if self.last_committed == step:
            self.last_committed = None
        self._save_started[step] = self._clock()

    def commit(self, step: int) -> CommitRecord:
        """Call after the framework wrote ``step``: hash its files, write the record last, delete what retention drops.

        :return: the record written.
        :raises FileNotFoundError: when the artifact is missing or holds no file.
        :raises OSError: when hashing or writing the record fails (then it is not committed).
        :raises SystemExit: 78, when a newer release's record appeared (then nothing is deleted)."""
        started = self._save_started.pop(step, None)
        hash_started = self._clock()
        record = self.commit_written(step)
        blocked = self._clock() - (hash_started if started is None else started)
        self.stats.blocking.append(blocked)
        self.stats.durations.append(blocked)
        self.stats.sizes.append(record.size)
        self.last_committed = step
        if self.attempt is not None:
            self.attempt.saved(blocked)
        self.log.info("checkpoint committed", step=step, checkpoint=record.name, bytes=record.size,
                      files=len(record.files), save_seconds=round(blocked, 4))
        self.refuse_newer_records()
        self.apply_retention(self.keep)
        return record

    def refuse_newer_records(self) -> None:
        """Stop the run when a newer release wrote a record here (resuming from an older artifact would lose the newer
        one's work): write ``FATAL`` (exit code, reason, ``newer_record``), log one error line, delete nothing.

        :raises SystemExit: 78 (``EX_CONFIG``), when there is such a record."""
        try:
            super().refuse_newer_records()
        except NewerCheckpointError as newer:
            raise SystemExit(write_fatal(self.folder, newer, self.log)) from None

    def latest(self) -> str | None:
        """:return: the path of the newest committed, intact artifact, or ``None``. Every newer artifact skipped is
            logged with the reason (never loaded; kept by retention unless corrupt: :meth:`~CommitStore.resumed_from`).
        :raises SystemExit: 78, when a newer release wrote a record here (:meth:`refuse_newer_records`)."""
        if self._restore_started is None:  # the restore begins with the search for a checkpoint
            self._restore_started = time.time()
        self.refuse_newer_records()
        for step in self.present_steps():
            ok, reason = self.verify(step)
            if ok:
                self.log.info("resuming from committed checkpoint", step=step, checkpoint=self.naming.build(step))
                self.last_committed = step
                self.resumed_from(step)
                return self.path(step)
            self.log.warning("skipping checkpoint", step=step, checkpoint=self.naming.build(step), reason=reason)
        self.resumed_from(0)
        return None

    def cleanup_uncommitted(self) -> None:
        """Delete what a killed attempt left (temp files, artifacts without a record), before a writer's first save.

        :raises SystemExit: 78, when a newer release wrote a record here (nothing is deleted)."""
        for step in sorted(set(self.cleanup_stale()), reverse=True):
            self.log.info("removing uncommitted checkpoint", step=step, checkpoint=self.naming.build(step))

    # SIGTERM at a step boundary ---------------------------------------------------------------
    def stop_action(self, step: int) -> str | None:
        """The decision at a step boundary (:func:`~gpu_resilience_worker.preemption.decide_stop`; 1 s is assumed
        for a save before the first measured one).

        :param step: the step just finished.
        :return: ``None`` (no stop requested: go on), ``"exit"`` (stop now: ``step`` is already committed, or a save
            would not fit the grace left) or ``"save"`` (save ``step``, commit it, then stop)."""
        estimate = self.stats.cost()
        decision = decide_stop(requested=self.watcher.requested, step=step, last_committed=self.last_committed,
                               estimated_save_seconds=estimate, remaining_grace=self.watcher.remaining_grace())
        if decision.action == CONTINUE:
            return None
        fields = {"step": step, "signal": self.watcher.signal_name, "estimated_save_seconds": round(estimate, 4),
                  "remaining_grace_seconds": round(self.watcher.remaining_grace(), 3),
                  "last_committed": self.last_committed, "reason": decision.reason}
        if decision.reason == NO_TIME_TO_SAVE:
            self.log.warning("preempted: final save skipped, it would not fit the grace period", **fields)
        else:
            self.log.info(f"preempted: {'saving at the step boundary' if decision.action != EXIT else 'stopping'}",
                          **fields)
        return decision.action

    # the attempt's account -------------------------------------------------------------------
    def begin_attempt(self, step: int, total_steps: int) -> None:
        """The framework restored its state and trains from ``step``: record the attempt (:meth:`Attempt.begin`),
        its restore counted from the first :meth:`latest` (else from now). In the writing process only.

        :param step: the step training starts from (0 when nothing was resumed).
        :param total_steps: the run's optimizer steps."""
        self.attempt = Attempt(self.storage, self.folder, total_steps, logger=self.log)
        self.attempt.begin(step, time.time() if self._restore_started is None else self._restore_started)

    def step_done(self, step: int, loss: float | None = None) -> None:
        """A step ended: ``step`` steps done (:meth:`Attempt.stepped`)."""
        if self.attempt is not None:
            self.attempt.stepped(step, loss)

    def end_attempt(self, step: int, code: int, metrics: dict | None = None) -> None:
        """The attempt ends at ``step`` with exit ``code``: 0 completes the run (``metrics.json`` with ``metrics``,
        :meth:`Attempt.complete`), 143 reports ``preempted``; the goodput file gets the status (:meth:`Attempt.end`)."""
        attempt, self.attempt = self.attempt, None
        if attempt is None:
            return
        attempt.step = step
        if code == EXIT_OK:
            attempt.complete(metrics)
        elif code == EXIT_PREEMPTED:
            attempt.report("preempted", max_wait=self.watcher.remaining_grace() - 1.0)
        attempt.end(code)

    def exit_preempted(self, step: int) -> None:
        """Log the stop, end the attempt's account and raise ``SystemExit(143)`` (a resumable interruption).

        :raises SystemExit: always, with code 143."""
        self.log.info("preempted: exiting", step=step, exit_code=EXIT_PREEMPTED, last_committed=self.last_committed,
                      remaining_grace_seconds=round(self.watcher.remaining_grace(), 3))
        self.end_attempt(step, EXIT_PREEMPTED)
        raise SystemExit(EXIT_PREEMPTED)

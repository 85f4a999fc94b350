"""The commit protocol for checkpoints that a training framework writes itself.

``transformers.Trainer`` writes ``checkpoint-<step>/`` folders and Lightning ``.ckpt`` files;
neither marks a finished checkpoint. :class:`ArtifactCheckpoints` adds the commit protocol around
those writes (:meth:`~ArtifactCheckpoints.begin_save` removes the stale record and artifact, the
framework writes, :meth:`~ArtifactCheckpoints.commit` hashes every file and writes the folder-shape
record of :mod:`gpu_resilience_worker.task_folder` last), the stop decision of
:mod:`gpu_resilience_worker.preemption`, and the attempt's record
(:class:`~gpu_resilience_worker.attempt.Attempt`), so a framework's folder holds the same files as
the bundled worker's (``docs/worker-contract.rst``). Local (or FUSE-mounted) paths only: the
frameworks write with ``open``/``os`` themselves.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from typing import Callable

from gpu_resilience_worker.attempt import Attempt
from gpu_resilience_worker.commit import first_newer_record, read_record
from gpu_resilience_worker.config import TaskIdentity
from gpu_resilience_worker.errors import EXIT_OK, EXIT_PREEMPTED, ConfigError, NewerCheckpointError
from gpu_resilience_worker.fastio import file_chunk_digests
from gpu_resilience_worker.fatal import write_fatal
from gpu_resilience_worker.logs import StructuredLogger, utc_now
from gpu_resilience_worker.policies import KeepLatestN, SaveStats
from gpu_resilience_worker.config import StopTiming
from gpu_resilience_worker.preemption import CONTINUE, EXIT, NO_TIME_TO_SAVE, PreemptionWatcher, decide_stop
from gpu_resilience_worker.storage import LocalStorage
from gpu_resilience_worker.task_folder import DIGEST_CHUNK, RECORD_SUFFIX, CommitRecord, FileEntry

_SAFE_AFFIX = re.compile(r"[A-Za-z0-9._=-]*")


class ArtifactCheckpoints:
    """Commit records, retention and the SIGTERM stop decision for a framework's own checkpoints.

    :param folder: where the framework writes its checkpoints (a local path).
    :param prefix: the artifact name before the step, e.g. ``"checkpoint-"``.
    :param suffix: the artifact name after the step, e.g. ``".ckpt"``; default none.
    :param keep_latest_k: committed artifacts to keep (>= 2); default 2.
    :param grace_seconds: SIGTERM to SIGKILL, in seconds; default ``PREEMPTION_GRACE_SECONDS`` or 10.
        The attempt's deadline is ``TASK_TIMEOUT_SECONDS``'s (:class:`~gpu_resilience_worker.config.StopTiming`).
    :param logger: structured logger; default one on stdout.
    :param clock: monotonic clock in seconds (save durations).
    :raises ValueError: for an empty folder, a prefix or suffix with other characters than
        letters, digits and ``._=-`` (or an empty prefix), ``keep_latest_k`` < 2 or ``grace_seconds`` <= 0.
    :raises ConfigError: a malformed ``PREEMPTION_GRACE_SECONDS`` or ``TASK_TIMEOUT_SECONDS``.
    """

    def __init__(self, folder: str, *, prefix: str, suffix: str = "", keep_latest_k: int = 2,
                 grace_seconds: float | None = None, logger: StructuredLogger | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(folder, (str, os.PathLike)) or not str(folder):
            raise ValueError(f"folder must be a non-empty path, got {folder!r}")
        if not isinstance(prefix, str) or not prefix or not _SAFE_AFFIX.fullmatch(prefix):
            raise ValueError(f"prefix must be non-empty letters, digits or ._=-, got {prefix!r}")
        if not isinstance(suffix, str) or not _SAFE_AFFIX.fullmatch(suffix) or suffix.endswith(RECORD_SUFFIX):
            raise ValueError(f"suffix must be letters, digits or ._=- (not a record name), got {suffix!r}")
        if isinstance(keep_latest_k, bool) or not isinstance(keep_latest_k, int) or keep_latest_k < 2:
            raise ValueError(f"keep_latest_k must be an int >= 2 (the newest may be in flight), got {keep_latest_k!r}")
        if grace_seconds is not None and not grace_seconds > 0:
            raise ValueError(f"grace_seconds must be > 0 seconds, got {grace_seconds!r}")
        self.folder = os.path.abspath(os.fspath(folder))
        self.prefix, self.suffix = prefix, suffix
        self._name_re = re.compile(rf"^{re.escape(prefix)}(\d+){re.escape(suffix)}$")
        self.keep = KeepLatestN(keep_latest_k)
        self.log = logger or StructuredLogger()
        self.watcher = PreemptionWatcher()
        StopTiming.from_env(grace_seconds=grace_seconds).apply(self.watcher)
        self.stats = SaveStats()
        self.last_committed: int | None = None
        self._storage = LocalStorage()
        self._clock = clock
        self._save_started: dict[int, float] = {}
        #: This attempt's account in the folder, from :meth:`begin_attempt` (the writer only).
        self.attempt: Attempt | None = None
        self._restore_started: float | None = None
        self._last_step_end, self._blocked = 0.0, 0.0

    # names -----------------------------------------------------------------------------------
    def name(self, step: int) -> str:
        """:return: the artifact name of ``step`` (``prefix + str(step) + suffix``)."""
        return f"{self.prefix}{step}{self.suffix}"

    def path(self, step: int) -> str:
        """:return: the artifact path of ``step``."""
        return os.path.join(self.folder, self.name(step))

    def record_path(self, step: int) -> str:
        """:return: the commit record path of ``step``."""
        return self.path(step) + RECORD_SUFFIX

    def present_steps(self) -> list[int]:
        """:return: every step with an artifact or a record (committed or not), newest first."""
        steps = set()
        for name in self._storage.list(self.folder):
            base = name[: -len(RECORD_SUFFIX)] if name.endswith(RECORD_SUFFIX) else name
            match = self._name_re.match(base)
            if match:
                steps.add(int(match.group(1)))
        return sorted(steps, reverse=True)

    # the protocol ----------------------------------------------------------------------------
    def _files(self, step: int) -> list[str]:
        """:return: the artifact's files as sorted paths relative to :attr:`folder`."""
        root = self.path(step)
        if os.path.isfile(root) and not os.path.islink(root):
            return [self.name(step)]
        found = []
        for base, dirs, files in os.walk(root):
            dirs.sort()
            for name in files:
                full = os.path.join(base, name)
                if not os.path.islink(full):
                    found.append(os.path.relpath(full, self.folder))
        return sorted(found)

    def begin_save(self, step: int) -> None:
        """Call before the framework writes ``step``: removes its stale record, then any stale
        artifact of that step, and starts the save's clock.

        :param step: the step about to be written (>= 0).
        """
        self._storage.remove(self.record_path(step))
        self._remove_data(step)
        if self.last_committed == step:
            self.last_committed = None
        self._save_started[step] = self._clock()

    def commit(self, step: int) -> CommitRecord:
        """Call after the framework wrote ``step``: hash its files, write the record last, then
        delete what the keep policy no longer keeps.

        :return: the record written.
        :raises FileNotFoundError: when the artifact is missing or holds no file.
        :raises OSError: when hashing or writing the record fails (then it is not committed).
        :raises SystemExit: 78, when a newer release's record appeared (then nothing is deleted).
        """
        started = self._save_started.pop(step, None)
        hash_started = self._clock()
        files = []
        for rel in self._files(step):
            size, chunks = file_chunk_digests(os.path.join(self.folder, rel), DIGEST_CHUNK)
            files.append(FileEntry(rel, size, DIGEST_CHUNK, tuple(chunks)))
        if not files:
            raise FileNotFoundError(f"no checkpoint written at {self.path(step)}")
        record = CommitRecord.of_files(step, self.name(step), files, utc_now())
        self._storage.write(self.record_path(step), record.to_bytes(), atomic=True)
        now = self._clock()
        size = record.size
        self.stats.blocking.append(now - (hash_started if started is None else started))
        self.stats.durations.append(self.stats.blocking[-1])
        self.stats.sizes.append(size)
        self.last_committed = step
        self._blocked += self.stats.blocking[-1]
        if self.attempt is not None:
            self.attempt.saved(self.stats.blocking[-1])
        self.log.info("checkpoint committed", step=step, checkpoint=self.name(step), bytes=size,
                      files=len(files), save_seconds=round(self.stats.blocking[-1], 4))
        self._apply_keep_policy()
        return record

    def _read_record(self, step: int) -> tuple[CommitRecord | None, str]:
        """:return: ``(record, "")``, or ``(None, reason)`` when it is missing or invalid.

        :raises NewerCheckpointError: when a newer release wrote it (not an invalid record).
        """
        try:
            record = read_record(self._storage, self.record_path(step))
        except FileNotFoundError:
            return None, "no commit record (uncommitted)"
        except (OSError, ValueError) as exc:
            return None, f"unreadable commit record: {exc}"
        if record.step != step or record.name != self.name(step):
            return None, "commit record does not match its step or its name"
        return record, ""

    def verify(self, step: int) -> tuple[bool, str]:
        """Check the artifact of ``step`` against its record, hashing every file it lists.

        :return: ``(True, "")`` when committed and intact, else ``(False, reason)``.
        :raises NewerCheckpointError: when a newer release wrote its record.
        """
        record, reason = self._read_record(step)
        if record is None:
            return False, reason
        for entry in record.files:
            full = os.path.join(self.folder, entry.path)
            if not os.path.isfile(full) or os.path.islink(full):
                return False, f"{entry.path} is missing"
            try:
                if os.path.getsize(full) != entry.size:
                    return False, f"{entry.path}: size does not match the commit record"
                _, chunks = file_chunk_digests(full, entry.chunk_bytes, entry.digest)
            except (OSError, ValueError) as exc:
                return False, f"{entry.path}: unreadable ({exc})"
            if tuple(chunks) != entry.chunks:
                return False, f"{entry.path}: {entry.digest} does not match the commit record"
        return True, ""

    def newer_record(self) -> NewerCheckpointError | None:
        """:return: the refusal of the newest record here that a newer release wrote, or ``None``."""
        return first_newer_record(self.present_steps(), self._read_record)

    def refuse_newer_records(self) -> None:
        """Stop the run when a newer release wrote a record here: resuming from an older artifact
        would lose the newer one's work. Writes ``FATAL`` in the folder (exit code, reason and
        ``newer_record``), logs one error line and deletes nothing.

        :raises SystemExit: 78 (``EX_CONFIG``), when there is such a record.
        """
        newer = self.newer_record()
        if newer is not None:
            raise SystemExit(write_fatal(self.folder, newer, self.log))

    def committed_steps(self) -> list[int]:
        """:return: the steps of committed, intact artifacts, newest first (hashes every file)."""
        return [s for s in self.present_steps() if self.verify(s)[0]]

    def latest(self) -> str | None:
        """:return: the path of the newest committed, intact artifact, or ``None``. Every newer
            artifact skipped is logged with the reason (never loaded, never deleted here).

        :raises SystemExit: 78, when a newer release wrote a record here (:meth:`refuse_newer_records`).
        """
        if self._restore_started is None:  # the restore begins with the search for a checkpoint
            self._restore_started = time.time()
        self.refuse_newer_records()
        for step in self.present_steps():
            ok, reason = self.verify(step)
            if ok:
                self.log.info("resuming from committed checkpoint", step=step, checkpoint=self.name(step))
                return self.path(step)
            self.log.warning("skipping checkpoint", step=step, checkpoint=self.name(step), reason=reason)
        return None

    def _remove_data(self, step: int) -> None:
        path = self.path(step)
        if os.path.islink(path) or os.path.isfile(path):
            os.remove(path)
        elif os.path.isdir(path):
            shutil.rmtree(path)

    def delete(self, step: int) -> None:
        """Delete the record of ``step``, then its artifact (a writer only)."""
        self._storage.remove(self.record_path(step))
        self._remove_data(step)

    def cleanup_uncommitted(self) -> None:
        """Delete every artifact without a valid record (left by a killed attempt); a writer
        calls it once it resumed, before its first save.

        :raises SystemExit: 78, when a newer release wrote a record here (nothing is deleted).
        """
        self.refuse_newer_records()
        for step in self.present_steps():
            ok, reason = self.verify(step)
            if not ok:
                self.log.info("removing uncommitted checkpoint", step=step, checkpoint=self.name(step), reason=reason)
                self.delete(step)
            elif self.last_committed is None or step > self.last_committed:
                self.last_committed = step

    def _apply_keep_policy(self) -> None:
        self.refuse_newer_records()
        valid = [s for s in self.present_steps() if self._read_record(s)[0] is not None]
        for step in self.keep.to_delete(self.present_steps(), valid):
            self.log.info("deleting old checkpoint", step=step, checkpoint=self.name(step))
            self.delete(step)

    # SIGTERM at a step boundary ---------------------------------------------------------------
    def stop_action(self, step: int) -> str | None:
        """The decision at a step boundary (:func:`~gpu_resilience_worker.preemption.decide_stop`;
        1 s is assumed for a save before the first measured one).

        :param step: the step just finished.
        :return: ``None`` (no stop requested: go on), ``"exit"`` (stop now: ``step`` is already
            committed, or a save would not fit the grace left) or ``"save"`` (save ``step``,
            commit it, then stop).
        """
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
        """The framework restored its state and trains from ``step``: record the attempt
        (``attempts.json``, the goodput restore, ``progress.json``). The restore counts from the
        first :meth:`latest` (else from now). Call it in the writing process only.

        :param step: the step training starts from (0 when nothing was resumed).
        :param total_steps: the run's optimizer steps.
        """
        try:
            identity = TaskIdentity.from_env(os.environ)
        except ConfigError:
            identity = TaskIdentity()
        self.attempt = Attempt(self._storage, self.folder, total_steps, identity, self.log)
        self.attempt.begin(step, time.time() if self._restore_started is None else self._restore_started)
        self._last_step_end, self._blocked = self._clock(), 0.0

    def step_done(self, step: int, loss: float | None = None) -> None:
        """A step ended: ``step`` steps done; its time since the last step's end, less the time
        saves blocked training, goes to the goodput file and ``progress.json`` when due."""
        now = self._clock()
        seconds, self._last_step_end, self._blocked = max(0.0, now - self._last_step_end - self._blocked), now, 0.0
        if self.attempt is not None:
            self.attempt.stepped(step, loss, seconds)

    def end_attempt(self, step: int, code: int) -> None:
        """The attempt ends at ``step`` with exit ``code`` (0: training complete, 143: stopped, else
        failed): ``progress.json`` and the goodput file get their final status."""
        if self.attempt is None:
            return
        self.attempt.step = step
        if code in (EXIT_OK, EXIT_PREEMPTED):
            self.attempt.report("completed" if code == EXIT_OK else "preempted",
                                max_wait=self.watcher.remaining_grace() - 1.0)
        self.attempt.end(code)
        self.attempt = None

    def exit_preempted(self, step: int) -> None:
        """Log the stop, end the attempt's account and raise ``SystemExit(143)``, the exit code of a
        resumable interruption.

        :raises SystemExit: always, with code 143.
        """
        self.log.info("preempted: exiting", step=step, exit_code=EXIT_PREEMPTED, last_committed=self.last_committed,
                      remaining_grace_seconds=round(self.watcher.remaining_grace(), 3))
        self.end_attempt(step, EXIT_PREEMPTED)
        raise SystemExit(EXIT_PREEMPTED)

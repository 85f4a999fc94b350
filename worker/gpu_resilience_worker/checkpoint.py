"""Checkpoints of the complete training state: when to save, the snapshot, what to keep, loading.

:class:`CheckpointManager` schedules saves (:mod:`gpu_resilience_worker.policies`), snapshots the state (into
reused host buffers for async saves), keeps the newest ``keep_latest_k`` and loads the newest
valid checkpoint. How a checkpoint is written, committed, verified and cleaned up is the commit
protocol of :mod:`gpu_resilience_worker.commit`.
"""

from __future__ import annotations

import io
import threading
import time
from typing import Any, Callable, Mapping, Protocol

from gpu_resilience_worker.commit import COMMIT, DATA, CommitStore
from gpu_resilience_worker.errors import OutOfSpaceError, SavesFailingError
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.policies import (  # noqa: F401 - AsyncMode and CheckpointConfig: the documented import path
    GO_ON, OUT_OF_SPACE, AsyncMode, CheckpointConfig, KeepLatestN, SavePolicy, SaveStats, failed_save_verdict,
)
from gpu_resilience_worker.restore_copy import LocalCopy, ModulePlacement
from gpu_resilience_worker.snapshot import SnapshotBuffers
from gpu_resilience_worker.storage import LocalStorage, Storage

MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE = "model", "optimizer", "lr_scheduler", "dataloader", "train_state"
#: The item names a checkpoint may hold, in the order they are saved.
STATE_KEYS = (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE)


class Stateful(Protocol):
    """An object whose state is saved in checkpoints."""

    def state_dict(self) -> dict[str, Any]:
        """:return: the state, as tensors, primitives, lists and dicts only."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state returned by :meth:`state_dict`."""


_THREAD_LOCAL_MMAP: bool | None = None


def _shared_mmap_is_thread_local() -> bool:
    """Whether ``torch.serialization.set_default_mmap_options`` as a context manager sets the
    mapping mode for the calling thread only (probed once, from a second thread). Where it is
    process-wide (torch 2.5 to 2.11) a shared mapping is not used: another thread's
    ``torch.load(mmap=True)`` would map its own file shared, and its edits would reach the file."""
    global _THREAD_LOCAL_MMAP
    if _THREAD_LOCAL_MMAP is None:
        import mmap

        import torch

        options = getattr(torch.serialization, "set_default_mmap_options", None)
        current = getattr(torch.serialization, "get_default_mmap_options", None)
        if not isinstance(options, type) or current is None or not hasattr(mmap, "MAP_SHARED"):
            _THREAD_LOCAL_MMAP = False
        else:
            seen: list[int] = []
            with options(mmap.MAP_SHARED):
                probe = threading.Thread(target=lambda: seen.append(current()), name="mmap-option-probe")
                probe.start()
                probe.join()
            _THREAD_LOCAL_MMAP = bool(seen) and seen[0] != mmap.MAP_SHARED
    return _THREAD_LOCAL_MMAP


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed (raised for a background save by the next wait or save); training
    may go on. ``__cause__``: the save's own error (for a write, an ``OSError`` with the path)."""


def _describe(error: BaseException) -> str:
    """:return: the type and message, with an ``OSError``'s path (``repr`` leaves it out)."""
    return f"{type(error).__name__}: {error}"


class RestoreInterrupted(Exception):
    """A restore ended because a stop was requested (a SIGTERM or the task deadline) while it was
    reading: nothing was loaded, and no checkpoint was judged. Raised by
    :meth:`CheckpointManager.load` when the manager has a ``should_stop``.

    :param step: the step whose checkpoint was being read, or ``None`` (between candidates).
    """

    def __init__(self, step: int | None) -> None:
        super().__init__(f"restore stopped{'' if step is None else f' while reading step {step}'}: a stop was requested")
        self.step = step


class CheckpointManager(CommitStore):
    """Schedules saves, snapshots the states, keeps the newest checkpoints and loads one.

    It is the :class:`~gpu_resilience_worker.commit.CommitStore` of ``config.folder``, which
    writes, commits, verifies and deletes. Constructing a manager, or asking it what is there (:meth:`latest_step`,
    :meth:`valid_steps`, :meth:`verify`, :meth:`load`), deletes nothing: stale files of a killed
    attempt are removed at the first save (or by :meth:`cleanup_stale`).

    A failed save raises :class:`CheckpointSaveError` (training goes on) until
    :data:`~gpu_resilience_worker.policies.MAX_FAILED_SAVES_IN_A_ROW` failed in a row, each counted
    at its outcome (a commit resets the count; a background save counts when it ends, not when the
    next starts); that one raises :class:`~gpu_resilience_worker.errors.OutOfSpaceError` (exit 74)
    or :class:`~gpu_resilience_worker.errors.SavesFailingError` (exit 1) instead.

    Interval saves are asynchronous unless ``config.async_mode`` is :attr:`AsyncMode.DISABLED`
    (see :meth:`save`). Use it as a context manager; :meth:`close` waits for the save in flight.

    :param config: the checkpoint configuration.
    :param states: the objects to checkpoint, keyed by item name (see :data:`STATE_KEYS`).
    :param storage: the storage backend; default :class:`~gpu_resilience_worker.storage.LocalStorage`.
    :param logger: structured logger; default one on stdout.
    :param clock: monotonic clock in seconds, for save timings and time-based intervals.
    :param should_stop: asked before each checkpoint a restore reads and between its reads
        (every 8 MiB); when it returns true, :meth:`load` raises :class:`RestoreInterrupted`, so a
        SIGTERM during a multi-GB restore (or its fallback past a corrupt checkpoint) ends the
        attempt within the grace period. Default: never (a restore always runs to its end).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        states: Mapping[str, Stateful],
        *,
        storage: Storage | None = None,
        logger: StructuredLogger | None = None,
        clock: Callable[[], float] = time.monotonic,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.config = config
        self._should_stop = should_stop or (lambda: False)
        self._states = dict(states)
        super().__init__(config.folder, storage or LocalStorage(), logger or StructuredLogger())
        self._clock = clock
        self._save_policy = config.save_policy()
        self._keep_policy = KeepLatestN(config.keep_latest_k)
        self._snapshots = SnapshotBuffers()
        self.stats = SaveStats()
        self._last_save_at = clock()
        self._logged_interval: float | None = None
        self.last_saved_step: int | None = None
        self.loaded_step: int | None = None
        self.failed_saves = 0
        self.failed_in_a_row = 0  # counted at each save's outcome (class docs)
        self._cleaned = False
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._closed = False
        self._log_auto_interval()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not hide the exception in flight behind a save error
            self.close()
        except Exception as exc:  # noqa: BLE001 - logged: the exception in flight is the one raised
            self._log.error("background checkpoint save failed during shutdown", error=str(exc))

    @property
    def estimated_save_seconds(self) -> float:
        """Seconds a synchronous save takes at the slowest measured throughput of the last
        five saves (1.0 before any save)."""
        return self.stats.estimated_seconds()

    def auto_interval_seconds(self) -> float | None:
        """:return: the Young/Daly interval now, in seconds, or ``None`` when not ``auto``.

        The cost is the median blocking time of recent saves; the interval is at least the last
        save's full duration, so an async save is never queued behind the previous one.
        """
        if not self.config.auto_interval:
            return None
        floor = self.stats.durations[-1] if self.stats.durations else 0.0
        return SavePolicy(mtbi=self.config.mtbi_seconds, floor=floor).interval(self.stats.cost())

    def _log_auto_interval(self) -> None:
        interval = self.auto_interval_seconds()
        if interval is None:
            return
        previous = self._logged_interval
        if previous is None or abs(interval - previous) > 0.1 * previous:
            self._logged_interval = interval
            self._log.info(
                f"checkpoint interval: {interval:.1f} s (Young/Daly)",
                interval_seconds=round(interval, 3), save_cost_seconds=round(self.stats.cost(), 4),
                mtbi_seconds=self.config.mtbi_seconds, measured=bool(self.stats.blocking),
            )

    def latest_step(self) -> int | None:
        """:return: the newest valid step, or ``None`` when there is none."""
        return next((step for step in self.present_steps() if self.is_valid(step)), None)

    def cleanup_stale(self) -> list[int]:
        """:meth:`CommitStore.cleanup_stale` now; the first save does it anyway."""
        self._cleaned = True
        return super().cleanup_stale()

    def due(self, step: int) -> bool:
        """:return: whether the save policy wants a checkpoint at ``step`` now."""
        elapsed = self._clock() - self._last_save_at
        return self._save_policy.should_save(step, elapsed, self.stats.cost())

    def save(self, step: int, *, force: bool = False) -> bool:
        """Save and commit a checkpoint of all states at ``step`` when the policy says so.

        In :attr:`AsyncMode.ASYNC`, an interval save copies the state to host memory here and
        writes and commits it on a background thread; forced saves are always synchronous. At
        most one save is in flight: a new one first waits for the previous one.

        :param step: the number of optimizer steps done.
        :param force: save regardless of the interval, synchronously (final step, preemption).
        :return: whether a checkpoint was written (or, in async mode, started).
        :raises CheckpointSaveError: when the previous background save failed (this save is
            then not started), or when a synchronous save fails; at too many failures in a row
            :class:`~gpu_resilience_worker.errors.OutOfSpaceError` or ``SavesFailingError`` instead.
        """
        if step == self.last_saved_step or not (force or self.due(step)):
            return False
        self.wait_until_finished()
        if step == self.last_saved_step:
            return False
        if not self._cleaned:  # this manager writes from now on: clear what a killed one left
            self.cleanup_stale()
        started = self._last_save_at = self._clock()
        if self.config.async_mode is AsyncMode.ASYNC and not force:
            snapshot = self._snapshots.copy(self._state_dicts())
            self.stats.blocking.append(self._clock() - started)
            self._thread = threading.Thread(
                target=self._save_in_background, args=(step, snapshot, started),
                name=f"checkpoint-{step}", daemon=True,
            )
            self._thread.start()
            return True
        try:
            self._commit(step, self._state_dicts(), started)
        except Exception as exc:
            self.failed_saves, self.failed_in_a_row = self.failed_saves + 1, self.failed_in_a_row + 1
            raise self._failure(f"checkpoint save of step {step} failed", exc) from exc
        self.stats.blocking.append(self._clock() - started)
        self._log_auto_interval()
        return True

    def _state_dicts(self) -> dict[str, Any]:
        return {key: obj.state_dict() for key, obj in self._states.items()}

    def _save_in_background(self, step: int, snapshot: dict[str, Any], started: float) -> None:
        # at the process's own priority: at nice 10 it was starved on busy cores until the next
        # save had to wait for it, and the training loop with it (docs/benchmarks.rst)
        try:
            self._commit(step, snapshot, started)
        except BaseException as exc:  # noqa: BLE001 - logged now, re-raised by wait_until_finished
            self.failed_saves, self.failed_in_a_row = self.failed_saves + 1, self.failed_in_a_row + 1
            self._error = (step, exc)
            self._log.error("background checkpoint save failed", step=step, error=_describe(exc),
                            file=self.path(step), failed_in_a_row=self.failed_in_a_row)

    def _failure(self, what: str, error: BaseException) -> Exception:
        """:return: the exception reporting a failed save to the caller, by
        :func:`~gpu_resilience_worker.policies.failed_save_verdict` on the count so far."""
        message = f"{what}: {_describe(error)}"
        verdict = failed_save_verdict(self.failed_in_a_row, error)
        if verdict == GO_ON:
            return CheckpointSaveError(message)
        folder, count = self.config.folder, self.failed_in_a_row
        if verdict == OUT_OF_SPACE:
            return OutOfSpaceError(f"checkpoint folder {folder} has no room for a checkpoint: {count} saves "
                                   f"failed in a row, the last with {error}; free space there, or give "
                                   "the run a folder with room")
        return SavesFailingError(f"{count} checkpoint saves failed in a row in {folder}; the last: {message}")

    def _commit(self, step: int, state: dict[str, Any], started: float) -> None:
        record = self.write(step, state)
        self.failed_in_a_row = 0
        seconds = self._clock() - started
        self.stats.durations.append(seconds)
        self.stats.sizes.append(record.size)
        self.last_saved_step = step
        mode = "async" if threading.current_thread() is self._thread else "sync"
        self._log.info("checkpoint saved", step=step, bytes=record.size, seconds=round(seconds, 4),
                       file=self.path(step), mode=mode)
        self.apply_retention(self._keep_policy)
        self._log_auto_interval()

    def load(self, step: int | None = None) -> bool:
        """Load the newest valid checkpoint (or ``step``) into the states.

        An invalid candidate (torn, truncated, corrupt, unloadable) is skipped with a WARNING
        naming its file, and the previous one is tried.

        A checkpoint found corrupt or unloadable is not counted by retention as kept (a valid one is
        not deleted in its place), nor deleted while newer than the one loaded (:meth:`CommitStore.resumed_from`).

        With :attr:`AsyncMode.ASYNC`, the loaded tensors a ``torch.nn.Module`` copied into itself
        stay as the next snapshot's buffers (:meth:`~gpu_resilience_worker.snapshot.SnapshotBuffers.adopt`).

        :param step: the step to load; default ``config.load_step`` (-1: newest valid).
        :return: whether a checkpoint was loaded (its step is then in ``loaded_step``).
        :raises RestoreInterrupted: when ``should_stop`` said so before or during a read.
        :raises NewerCheckpointError: a newer release's commit record is here (exit 78; nothing read).
        """
        wanted = self.config.load_step if step is None else step
        self.refuse_newer_records()
        candidates = self.present_steps(COMMIT) if wanted == -1 else [wanted]
        for candidate in candidates:
            if self._should_stop():
                raise RestoreInterrupted(None)
            loaded = self._read_state(candidate)
            if loaded is None:
                continue
            state, copy, placement = loaded
            try:  # a load_state_dict that raises leaves the placed entries in, as torch's leaves what it copied
                live = placement.into(state, copy.placed)
                for key, obj in self._states.items():
                    obj.load_state_dict(live[key])
            finally:
                copy.keep_placed()
                copy.close()  # a memory-mapped state keeps its pages until it is dropped
            if self.config.async_mode is AsyncMode.ASYNC:
                self._adopt_restored(state)
            self.loaded_step = self.last_saved_step = candidate
            self.resumed_from(candidate)
            return True
        self.resumed_from(0)
        return False

    def _adopt_restored(self, state: dict[str, Any]) -> None:
        """Keep the loaded tensors of the ``torch.nn.Module`` states as snapshot buffers, none that any state's
        ``state_dict()`` shows (``assign=True``, or another state, may keep a loaded tensor)."""
        import torch

        modules = [key for key, obj in self._states.items() if isinstance(obj, torch.nn.Module)]
        live = {key: obj.state_dict() for key, obj in self._states.items()}
        self._snapshots.adopt({key: state[key] for key in modules}, live)

    def _deserialize(self, copy: LocalCopy) -> Any:
        """Load a verified local copy with the ``weights_only`` unpickler (no code runs). A ``memfd`` copy is mapped
        shared where torch keeps that choice per thread (:func:`_shared_mmap_is_thread_local`), so tensors that stay
        loaded (an optimizer's moments) take their first writes with no copy-on-write fault per page; otherwise
        privately, or read into memory where it cannot be mapped. The checkpoint is never read again."""
        import mmap

        import torch

        private = getattr(mmap, "MAP_PRIVATE", None)
        if copy.path is None or private is None:  # an in-memory copy; or no mmap flags (Windows)
            if copy.path is None:
                data = copy.buffer[: copy.size]
            else:
                with open(copy.path, "rb") as handle:
                    data = handle.read()
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True, mmap=False)
        options = getattr(torch.serialization, "set_default_mmap_options", None)
        if copy.in_memory and _shared_mmap_is_thread_local():
            try:
                with options(mmap.MAP_SHARED):
                    return torch.load(copy.path, map_location="cpu", weights_only=True, mmap=True)
            except (OSError, RuntimeError) as exc:
                self._log.debug("shared memory-mapped load failed; trying a private mapping", error=str(exc))
        flags = getattr(torch.serialization, "get_default_mmap_options", lambda: private)()
        if flags == private:
            try:
                return torch.load(copy.path, map_location="cpu", weights_only=True, mmap=True)
            except (OSError, RuntimeError) as exc:
                self._log.debug("memory-mapped load failed; reading into memory", error=str(exc))
        with open(copy.path, "rb") as handle:
            return torch.load(io.BytesIO(handle.read()), map_location="cpu", weights_only=True, mmap=False)

    def _read_state(self, step: int) -> tuple[dict[str, Any], LocalCopy, ModulePlacement] | None:
        """:return: the state of ``step`` as loaded, its copy (open: it may have placed storages
        into the modules' tensors, put back when it closes) and the placement; ``None`` when invalid."""
        placement = ModulePlacement(self._states)
        copy, reason = self.read_verified(step, self._should_stop, placement)  # the one read of the data
        if copy is None and self._should_stop():
            raise RestoreInterrupted(step)
        if copy is not None:
            try:
                if copy.displaced_bytes and not placement.check(copy):
                    copy.unplace()
                state = self._deserialize(copy)
                missing = [key for key in self._states if key not in state]
                if not missing:
                    return state, copy, placement
                reason = f"checkpoint lacks items {missing}"
            except Exception as exc:  # noqa: BLE001 - any unpickling failure means "skip it"
                reason = f"torch.load failed: {exc}"
            except BaseException:  # an interrupt: the copy still puts back what it placed
                copy.close()
                raise
            copy.close()
            self.mark_invalid(step)  # verified bytes that do not load: retention skips it
        self._log.warning(
            "skipping invalid checkpoint", file=self.path(step, DATA), step=step, reason=reason
        )
        return None

    @property
    def in_flight(self) -> bool:
        """Whether a background save is still running."""
        return self._thread is not None and self._thread.is_alive()

    def wait_until_finished(self, timeout: float | None = None) -> bool:
        """Wait for the save in flight, if any, and re-raise its error.

        :param timeout: seconds to wait at most; default no limit.
        :return: ``False`` when the save is still running after ``timeout``, else ``True``.
        :raises CheckpointSaveError: when the background save failed (raised once; at too many
            failures in a row ``OutOfSpaceError`` or ``SavesFailingError`` instead).
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        failed, self._error = self._error, None
        if failed is not None:
            step, error = failed
            raise self._failure(f"background checkpoint save of step {step} failed", error) from error
        return True

    def abandon(self) -> None:
        """Stop waiting for the save in flight: the process is about to exit (preemption), and
        an uncommitted checkpoint is ignored by every later reader."""
        self._closed = True

    def close(self) -> None:
        """Finish the save in flight (re-raising its error); do not use the manager afterwards."""
        if not self._closed:
            self._closed = True
            self.wait_until_finished()

"""A plain training loop made preemption-safe: :class:`ResilientLoop` and :func:`run_training`.

The user writes ``step_fn(step) -> loss`` (it does optimizer step ``step + 1``) and hands over the objects it changes.
The loop resumes from the newest committed checkpoint, records the attempt, saves on its interval, answers a stop
(SIGTERM/SIGINT or the task deadline) through :func:`~gpu_resilience_worker.preemption.decide_stop` and returns the
exit code for :func:`exit_now`. Step by step, and what bit-identical resume asks of ``step_fn``: ``docs/your-code.rst``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Callable, Mapping, Sequence

from gpu_resilience_worker.attempt import Attempt
from gpu_resilience_worker.checkpoint import TRAIN_STATE, CheckpointManager, CheckpointSaveError, RestoreInterrupted, Stateful
from gpu_resilience_worker.config import StopTiming, TaskIdentity, task_namespace  # noqa: F401 - re-exported
from gpu_resilience_worker.errors import EXIT_OK, EXIT_PREEMPTED, DivergedError, WorkerError, check_number
from gpu_resilience_worker.fatal import check_writable, invocation, run_guarded, write_fatal
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.policies import AsyncMode, CheckpointConfig
from gpu_resilience_worker.preemption import PREEMPTION_SAVES, SAVE, PreemptionWatcher, decide_stop
from gpu_resilience_worker.state import TrainState, match_threads, settle_vector_math
from gpu_resilience_worker.storage import LocalStorage, Storage

#: Seconds the loop keeps for its exit: the waits of ``_on_stop`` end this long before the expected kill.
EXIT_RESERVE_SECONDS = 1.0
#: The loop's numeric options: (minimum, an int, strictly above it); grace and timeout: :meth:`StopTiming.check`.
_NUMBERS = {"total_steps": (1, True, False), "checkpoint_every": (0, True, False),
            "checkpoint_every_seconds": (0, False, False), "mtbi_seconds": (0, False, True),
            "keep_latest_k": (2, True, False), "progress_interval": (0, False, False)}


def _check_options(states: Any, folder: Any, preemption_save: Any, **numbers: Any) -> None:
    """:raises ValueError: the first option out of range, by name (see :class:`ResilientLoop`)."""
    if not isinstance(states, Mapping) or not states:
        raise ValueError(f"states must be a non-empty mapping of name -> stateful object, got {states!r}")
    for name, obj in states.items():
        if not isinstance(name, str) or not name or name == TRAIN_STATE:
            raise ValueError(f"states: {name!r} is not allowed as a name (a non-empty str other than {TRAIN_STATE!r})")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ValueError(f"states[{name!r}] has no state_dict()/load_state_dict(): {type(obj).__name__}")
    for name, value in numbers.items():
        minimum, integer, strict = _NUMBERS[name]
        check_number(name, value, minimum=minimum, integer=integer, strict=strict)
    if preemption_save not in PREEMPTION_SAVES:
        raise ValueError(f"preemption_save must be one of {PREEMPTION_SAVES}, got {preemption_save!r}")
    if folder is not None and (not isinstance(folder, (str, os.PathLike)) or not str(folder)):
        raise ValueError(f"folder must be a non-empty path, got {folder!r}")


class ResilientLoop:
    """Runs a user's ``step_fn`` (or the bundled trainer's) to ``total_steps`` through preemptions.

    :param states: the objects to checkpoint, keyed by name (e.g. ``{"model": model, "optimizer": optimizer}``), each
        with ``state_dict()`` and ``load_state_dict()``. The name ``train_state`` is the loop's own (step, losses,
        attempt history, RNG states).
    :param total_steps: optimizer steps of the whole run, >= 1.
    :param folder: the task's checkpoint folder; default :func:`task_namespace` (from the environment).
    :param checkpoint_every: save every this many steps; default 50; 0: no step interval.
    :param checkpoint_every_seconds: also save when this many seconds passed since the last save; default 0 (off).
    :param auto_interval: save at the Young/Daly interval from the measured save cost and ``mtbi_seconds``; default off.
    :param mtbi_seconds: mean time between interruptions for ``auto_interval``, seconds; default 3600.
    :param keep_latest_k: valid checkpoints kept, >= 2; default 2.
    :param async_save: interval saves on a background thread (default) or on the training thread; saves at a stop and at
        the end are always synchronous.
    :param preemption_save: one of :data:`~gpu_resilience_worker.preemption.PREEMPTION_SAVES`; default ``deadline``.
    :param settings: the hyper-parameters (JSON types; ``total_steps`` always among them) a checkpoint must have been
        written with to be resumed; a checkpoint with others fails with exit 78 and ``FATAL``.
    :param grace_seconds: SIGTERM to SIGKILL, seconds; default ``$PREEMPTION_GRACE_SECONDS``, else 10.
    :param task_timeout_seconds: the attempt's timeout, seconds; default ``$TASK_TIMEOUT_SECONDS``, else none (see
        :func:`set_task_deadline`).
    :param watcher: a :class:`PreemptionWatcher` installed earlier (to catch a SIGTERM that comes while the model is
        built); default one installed by :meth:`run` for its duration.
    :param logger: structured logger; default JSON lines on stdout.
    :param storage: the storage backend; default local files (a mounted bucket is local files).
    :param env: the environment for the defaults above; default ``os.environ``.
    :param argv: what a ``FATAL`` marker is tied to; default ``sys.argv[1:]``.
    :param input_path: an input file a ``FATAL`` marker is tied to as well (its size and modification time: a retry with
        a changed file ignores the marker); default none.
    :param progress_interval: minimum seconds between ``progress.json`` writes; default 1.
    :param checkpointing: ``False``: no checkpoint is read or written, not even at a stop or at the end (every attempt
        starts at step 0); default ``True``.
    :param threads: the torch intra-op thread count the caller pinned, kept on resume with a warning; default ``None``:
        a resumed attempt trains on with its checkpoint's count (:func:`~gpu_resilience_worker.state.match_threads`).
    :param train_state: the loop's own checkpointed state; default a new
        :class:`~gpu_resilience_worker.state.TrainState` of ``settings`` (with ``total_steps``). One given keeps its own
        settings (the bundled worker's, as its checkpoints record them).
    :raises ValueError: a parameter out of range, naming it (nothing is touched before)."""

    def __init__(self, states: Mapping[str, Stateful], *, total_steps: int, folder: str | None = None,
                 checkpoint_every: int = 50, checkpoint_every_seconds: float = 0.0, auto_interval: bool = False,
                 mtbi_seconds: float = 3600.0, keep_latest_k: int = 2, async_save: bool = True,
                 preemption_save: str = "deadline", settings: Mapping[str, Any] | None = None,
                 grace_seconds: float | None = None, task_timeout_seconds: float | None = None,
                 watcher: PreemptionWatcher | None = None, logger: StructuredLogger | None = None,
                 storage: Storage | None = None, env: Mapping[str, str] | None = None,
                 argv: Sequence[str] | None = None, input_path: str | None = None, progress_interval: float = 1.0,
                 checkpointing: bool = True, threads: int | None = None, train_state: TrainState | None = None) -> None:
        _check_options(states, folder, preemption_save, total_steps=total_steps, checkpoint_every=checkpoint_every,
                       checkpoint_every_seconds=checkpoint_every_seconds, mtbi_seconds=mtbi_seconds,
                       keep_latest_k=keep_latest_k, progress_interval=progress_interval)
        StopTiming.check(grace_seconds, task_timeout_seconds)
        self.states, self.total_steps = dict(states), total_steps
        self._folder = None if folder is None else os.fspath(folder)
        self._checkpoint = {
            "interval": checkpoint_every, "interval_seconds": float(checkpoint_every_seconds),
            "auto_interval": bool(auto_interval), "mtbi_seconds": float(mtbi_seconds), "keep_latest_k": keep_latest_k,
            "async_mode": AsyncMode.ASYNC if async_save else AsyncMode.DISABLED}
        self.preemption_save, self.checkpointing, self._threads = preemption_save, bool(checkpointing), threads
        self._grace, self._timeout, self._progress_interval = grace_seconds, task_timeout_seconds, progress_interval
        self._env = os.environ if env is None else env
        self._argv, self._input = list(sys.argv[1:] if argv is None else argv), input_path
        self.watcher: PreemptionWatcher | None = watcher
        self._log, self._storage = logger or StructuredLogger(), storage or LocalStorage()
        #: The loop's checkpointed state: ``step``, ``loss_ema``, ``history``... (after :meth:`run`).
        self.state = train_state or TrainState({"total_steps": total_steps, **dict(settings or {})})
        self.settings = self.state.fingerprint
        #: The checkpoint step this attempt resumed from (0: started afresh).
        self.resumed_from_step = 0
        self.namespace: str | None = self._folder
        #: This attempt's account in the task folder (once :meth:`run` got to the restore).
        self.attempt: Attempt | None = None
        self._started = time.monotonic()

    @property
    def step(self) -> int:
        """Steps done so far (the argument of the next ``step_fn`` call)."""
        return self.state.step

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds`` inside ``step_fn`` (pacing, polling), waking at a stop request.

        :return: whether a stop was requested."""
        if self.watcher is None:
            time.sleep(max(0.0, seconds))
            return False
        return self.watcher.wait(seconds)

    def run(self, step_fn: Callable[[int], float | None], finish: Callable[[], Mapping[str, Any]] | None = None) -> int:
        """Resume, train to ``total_steps`` or until stopped, and finish.

        :param step_fn: does one optimizer step; called with the number of steps done so far (0-based); returns
            the step's loss (a float, or ``None``). A non-finite loss ends the run with exit 70 (diverged, ``FATAL``).
        :param finish: called once after the last step; its mapping (JSON types: e.g. the held-out accuracy) goes
            into ``metrics.json``.
        :return: the exit code: 0 done, 143 stopped (resumable), 78/65/70/74 a
            :class:`~gpu_resilience_worker.errors.WorkerError` (``FATAL`` written; 74: three saves in a row found
            no space), 73 the folder is not writable, 1 any other error (retryable)."""
        if not callable(step_fn):
            raise ValueError(f"step_fn must be callable, got {step_fn!r}")
        if finish is not None and not callable(finish):
            raise ValueError(f"finish must be callable or None, got {finish!r}")
        installed = None
        if self.watcher is None:
            installed = self.watcher = PreemptionWatcher()
            installed.install()
        try:
            code = self._run_guarded(step_fn, finish)
            if self.attempt is not None:
                self.attempt.end(code)
            return code
        finally:
            if installed is not None:
                installed.uninstall()

    def _run_guarded(self, step_fn: Callable[[int], float | None],
                     finish: Callable[[], Mapping[str, Any]] | None) -> int:
        called_as = invocation(self._argv, self._input)
        try:
            self.namespace = self._folder or task_namespace(self._env)
            StopTiming.from_env(self._env, grace_seconds=self._grace, task_timeout_seconds=self._timeout).apply(
                self.watcher)
        except WorkerError as exc:
            return write_fatal(self.namespace, exc, self._log, called_as)
        self._log = TaskIdentity.from_env(self._env, fallback=True).bind(self._log)
        return run_guarded(self.namespace, self._log, called_as, lambda: self._train(step_fn, finish))

    def _train(self, step_fn: Callable[[int], float | None], finish: Callable[[], Mapping[str, Any]] | None) -> int:
        check_writable(self.namespace)
        if self.watcher.requested:  # stopped during the start-up: nothing past the last checkpoint exists
            return self._stopped_early("during start-up; exiting before the restore")
        config = CheckpointConfig(folder=self.namespace, **self._checkpoint)
        self.attempt = Attempt(self._storage, self.namespace, self.total_steps,
                               TaskIdentity.from_env(self._env, fallback=True), self._log,
                               progress_interval=self._progress_interval)
        with CheckpointManager(config, {TRAIN_STATE: self.state, **self.states}, storage=self._storage,
                               logger=self._log, should_stop=lambda: self.watcher.requested) as manager:
            restore_started = time.time()
            try:
                self._resume(manager)
            except RestoreInterrupted:  # a SIGTERM while a checkpoint was read: nothing to save
                return self._stopped_early("during the restore; exiting without it")
            self.state.history.append(self.attempt.begin(self.state.step, restore_started))
            self.attempt.loss = self.state.loss_ema
            code = self._steps(manager, step_fn)
            if code == EXIT_OK:
                self._finish(manager, finish)
        return code

    def _stopped_early(self, where: str) -> int:
        """A stop before the first step ends the attempt at once: nothing past the last checkpoint exists.
        :return: 143."""
        watcher = self.watcher
        self._log.warning(f"{watcher.signal_name} received {where}", signal=watcher.signal_name,
                          remaining_grace_seconds=round(watcher.remaining_grace(), 3))
        self._log.warning("exiting: interrupted, resumable", exit_code=EXIT_PREEMPTED, step=None,
                          last_checkpoint_step=None)
        return EXIT_PREEMPTED

    def _steps(self, manager: CheckpointManager, step_fn: Callable[[int], float | None]) -> int:
        """Call ``step_fn`` until ``total_steps`` or a stop. :return: 0, or 143 after a stop."""
        while self.state.step < self.total_steps:
            if self.watcher.requested:
                return self._on_stop(manager)
            try:
                loss = step_fn(self.state.step)
            except Exception as exc:
                if not self.watcher.requested:
                    raise
                # a DataLoader worker still starting (before worker_init_fn) dies of Cloud Run's group-wide signal
                self._log.warning("the step raised after the stop request; answered as the stop, "
                                  "without saving the interrupted step", error=repr(exc), step=self.state.step)
                return self._on_stop(manager, step_torn=True)
            if loss is not None:
                loss = float(loss)
                if not math.isfinite(loss):
                    raise DivergedError(f"training diverged: the loss is {loss} at step {self.state.step + 1}")
                self.state.observe(loss)
            self.state.step += 1
            self._save(manager, force=False)
            self.attempt.stepped(self.state.step, self.state.loss_ema)
        return EXIT_OK

    def _resume(self, manager: CheckpointManager) -> None:
        settle_vector_math()
        if self.checkpointing and manager.load():
            step = self.resumed_from_step = self.state.step
            self.state.checkpoints += 1  # the loaded checkpoint itself
            self._log.info(f"resuming from step {step}", resumed_from_step=step, file=manager.path(step))
            match_threads(self.state.saved_threads, self._threads, step, self._log)
        else:
            self._log.info("no checkpoint found; starting from step 0", resumed_from_step=0)

    def _save(self, manager: CheckpointManager, *, force: bool) -> bool:
        """Save through ``manager`` (the time training was blocked goes to the goodput file); a failed save
        is logged and training goes on, until the manager ends the attempt."""
        began = time.monotonic()
        try:
            saved = manager.save(self.state.step, force=force)
        except CheckpointSaveError as exc:  # the manager ends the attempt at too many in a row
            self.attempt.saved(time.monotonic() - began, saved=False)
            self._log.error("checkpoint save failed; training goes on", step=self.state.step, error=str(exc),
                            failed_in_a_row=manager.failed_in_a_row, failed_saves=manager.failed_saves)
            return False
        self.attempt.saved(time.monotonic() - began, saved=saved)
        if saved:  # the previous background save, if any, committed too
            self.state.checkpoints += 1
        return saved

    def _settle(self, manager: CheckpointManager, step: int) -> bool:
        """Wait for the save in flight until shortly before the kill; abandon it when out of time.
        :return: whether it settled (committed or failed)."""
        watcher, began, settled = self.watcher, time.monotonic(), True
        try:
            settled = manager.wait_until_finished(timeout=max(0.0, watcher.remaining_grace() - EXIT_RESERVE_SECONDS))
        except CheckpointSaveError as exc:
            self._log.error("background checkpoint save failed", error=str(exc), step=step)
        if not settled:
            self._log.warning("abandoning the checkpoint save in flight: no time left", step=step)
            manager.abandon()
        self.attempt.saved(time.monotonic() - began, saved=False)
        return settled

    def _on_stop(self, manager: CheckpointManager, step_torn: bool = False) -> int:
        """Answer a stop request: settle the save in flight, save where :func:`decide_stop` says, exit 143.

        :param step_torn: the step after ``self.state.step`` raised midway: the model and optimizer may hold
            part of it, so no final save is made (the last checkpoint stays in force)."""
        step, watcher = self.state.step, self.watcher
        self._log.warning(f"{watcher.signal_name} received; stopping at step {step}", signal=watcher.signal_name,
                          step=step, remaining_grace_seconds=round(watcher.remaining_grace(), 3))
        settled = self._settle(manager, step)
        decision = decide_stop(requested=True, step=step, last_committed=manager.last_saved_step,
                               estimated_save_seconds=manager.estimated_save_seconds,
                               remaining_grace=watcher.remaining_grace(), mode=self.preemption_save,
                               step_torn=step_torn, save_abandoned=not settled, checkpointing=self.checkpointing)
        self._log.info(decision.reason, step=step, action=decision.action, last_checkpoint_step=manager.last_saved_step,
                       estimated_save_seconds=round(manager.estimated_save_seconds, 4),
                       remaining_grace_seconds=round(watcher.remaining_grace(), 3))
        if decision.action == SAVE:
            self._save(manager, force=True)
        self.attempt.report("preempted", max_wait=watcher.remaining_grace() - EXIT_RESERVE_SECONDS)
        self._log.warning("exiting: interrupted, resumable", exit_code=EXIT_PREEMPTED, step=step,
                          last_checkpoint_step=manager.last_saved_step)
        return EXIT_PREEMPTED

    def _finish(self, manager: CheckpointManager, finish: Callable[[], Mapping[str, Any]] | None) -> None:
        total = self.total_steps
        if self.checkpointing:
            try:
                manager.wait_until_finished()
            except CheckpointSaveError as exc:
                self._log.error("background checkpoint save failed", error=str(exc), step=total)
            if not self._save(manager, force=True) and manager.last_saved_step != total:
                raise CheckpointSaveError(f"the final checkpoint of step {total} was not written")
        metrics = self.attempt.complete({
            **(dict(finish() or {}) if finish is not None else {}), "settings": self.settings,
            "wall_seconds": round(self.state.elapsed_seconds, 3),
            "attempt_wall_seconds": round(time.monotonic() - self._started, 3),
            "checkpoints_written": self.state.checkpoints, "failed_saves": manager.failed_saves,
            "history": self.state.history})
        self._log.info("training complete", resumed_from_step=self.resumed_from_step,
                       **{k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool, type(None)))})


def run_training(step_fn: Callable[[int], float | None], states: Mapping[str, Stateful], *, total_steps: int,
                 finish: Callable[[], Mapping[str, Any]] | None = None, **options: Any) -> int:
    """``ResilientLoop(states, total_steps=..., **options).run(step_fn, finish)`` in one call.

    :param step_fn: does one optimizer step (see :meth:`ResilientLoop.run`).
    :param states: the checkpointed objects by name (see :class:`ResilientLoop`).
    :param total_steps: optimizer steps of the whole run.
    :param finish: metrics for ``metrics.json`` after the last step, or ``None``.
    :param options: the other keyword parameters of :class:`ResilientLoop`.
    :return: the exit code (0, 143, 78/65/70/73/74, 1); hand it to :func:`exit_now`.
    :raises ValueError: a bad parameter (before anything is touched)."""
    return ResilientLoop(states, total_steps=total_steps, **options).run(step_fn, finish)

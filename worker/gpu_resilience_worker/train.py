"""The training run: build, resume, train with checkpoints, stop on preemption, finish."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import torch
from torch import nn

from gpu_resilience_worker import checkpoint as ckpt
from gpu_resilience_worker.config import WorkerConfig
from gpu_resilience_worker.data import Dataset, EpochSampler, load_dataset
from gpu_resilience_worker.errors import EXIT_OK, EXIT_PREEMPTED, ConfigError, DivergedError
from gpu_resilience_worker.goodput import GoodputRecorder
from gpu_resilience_worker.files import (
    METRICS, PROGRESS, ProgressReporter, highest_reported_step, read_json, record_attempt, write_json,
)
from gpu_resilience_worker.logs import StructuredLogger, utc_now
from gpu_resilience_worker.preemption import SAVE, PreemptionWatcher, decide_stop, stopped_during_startup
from gpu_resilience_worker.state import TrainState, state_digest
from gpu_resilience_worker.storage import LocalStorage, Storage


class MLP(nn.Module):
    """Two hidden ReLU layers with dropout.

    :param inputs: input features.
    :param hidden: hidden units per layer.
    :param classes: output classes.
    :param dropout: dropout probability.
    """

    def __init__(self, inputs: int, hidden: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(inputs, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """:return: class logits."""
        return self.net(x)


def select_device(name: str) -> torch.device:
    """:return: the device for ``auto``/``cpu``/``cuda``; raises ConfigError if CUDA is missing."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda requested but CUDA is not available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def configure_torch(threads: int | None) -> None:
    """Deterministic algorithms (warn-only) and, when given, the CPU thread count."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if threads is not None:
        torch.set_num_threads(threads)


@dataclasses.dataclass
class Components:
    """The checkpointed objects of one run."""

    model: MLP
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: EpochSampler
    state: TrainState

    def stateful(self) -> dict[str, ckpt.Stateful]:
        """:return: the checkpoint items; ``train_state`` first, so settings are checked first."""
        return {
            ckpt.TRAIN_STATE: self.state, ckpt.MODEL: self.model, ckpt.OPTIMIZER: self.optimizer,
            ckpt.LR_SCHEDULER: self.lr_scheduler, ckpt.DATALOADER: self.sampler,
        }


def build_components(config: WorkerConfig, data: Dataset, device: torch.device) -> Components:
    """Build model, optimizer, scheduler, sampler and train state from the seed."""
    train = config.train
    torch.manual_seed(train.seed)
    model = MLP(data.num_features, train.hidden, data.num_classes, train.dropout).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=train.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=train.steps)
    sampler = EpochSampler(int(data.x_train.shape[0]), train.batch_size, train.seed)
    return Components(model, optimizer, scheduler, sampler, TrainState(train.fingerprint()))


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """:return: accuracy of ``model`` on ``(x, y)``, in [0, 1]."""
    model.eval()
    with torch.no_grad():
        predicted = model(x).argmax(dim=1)
    model.train()
    return float((predicted == y).float().mean().item())


class Trainer:
    """Runs one attempt of the task.

    :param config: the validated configuration.
    :param logger: structured logger.
    :param watcher: the installed preemption watcher.
    :param storage: storage backend; default local files.
    """

    def __init__(
        self, config: WorkerConfig, logger: StructuredLogger, watcher: PreemptionWatcher,
        storage: Storage | None = None,
    ) -> None:
        self.config = config
        self._log = logger
        self._watcher = watcher
        self._storage = storage or LocalStorage()
        self._started = time.monotonic()
        self._attempts: list[dict[str, Any]] = []
        self._high_water_step = 0
        self._failed_total = 0
        identity = config.identity
        self.goodput = GoodputRecorder(self._storage, config.namespace, identity.execution,
                                       identity.task_index, identity.task_attempt, logger=logger)

    def _path(self, name: str) -> str:
        return os.path.join(self.config.namespace, name)

    def run(self) -> int:
        """Train to the end or until preempted.

        :return: the exit code: 0 when done, 143 when interrupted.
        :raises ConfigError: bad settings. :raises DataError: bad data.
        """
        try:
            code = self._run()
        except BaseException:
            self.goodput.end("failed")
            raise
        self.goodput.end("completed" if code == EXIT_OK else "preempted", code)
        return code

    def _run(self) -> int:
        configure_torch(self.config.train.threads)
        device = select_device(self.config.train.device)
        data = load_dataset(self.config.data_path)
        data = Dataset(*(t.to(device) for t in dataclasses.astuple(data)))
        parts = build_components(self.config, data, device)
        self._log_setup(device)
        if self._watcher.requested:  # stopped while torch loaded or the model was built: nothing to save
            return stopped_during_startup(self._watcher, self._log)
        with ckpt.CheckpointManager(self.config.checkpoint, parts.stateful(), storage=self._storage,
                                    logger=self._log, should_stop=lambda: self._watcher.requested) as manager:
            try:
                self._resume(manager, parts)
            except ckpt.RestoreInterrupted:  # a SIGTERM while a checkpoint was read: nothing to save
                return stopped_during_startup(self._watcher, self._log, during_restore=True)
            progress = ProgressReporter(
                self._storage, self.config.namespace, self.config.train.steps, parts.state.step,
                self._log, min_interval=self.config.progress_interval, high_water_step=self._high_water_step,
            )
            code = self._train_loop(manager, parts, data, progress)
            if code != EXIT_OK:
                return code
            self._finish(manager, parts, data, progress)
        return EXIT_OK


    def _log_setup(self, device: torch.device) -> None:
        config, train = self.config, self.config.train
        checkpoint = config.checkpoint
        self._log.info(
            "training setup", device=str(device), lr=train.lr, hidden=train.hidden,
            sweep_member=config.sweep_member, task_count=config.identity.task_count,
            checkpoint_every_steps=checkpoint.interval or None,
            checkpoint_every_seconds=checkpoint.interval_seconds or None,
            checkpoint_interval_auto=checkpoint.auto_interval, checkpointing=checkpoint.enabled,
            save_mode=checkpoint.async_mode.value, preemption_save=config.preemption_save,
            threads=torch.get_num_threads(), mkl_cbwr=os.environ.get("MKL_CBWR"),
            mkl_dynamic=os.environ.get("MKL_DYNAMIC"), omp_dynamic=os.environ.get("OMP_DYNAMIC"),
        )

    def _resume(self, manager: ckpt.CheckpointManager, parts: Components) -> None:
        previous = read_json(self._storage, self._path(PROGRESS)) or {}
        reported = previous.get("step") if isinstance(previous.get("step"), int) else None
        highest = highest_reported_step(previous)
        restore_start = time.time()
        if self.config.checkpoint.enabled and manager.load():
            step = parts.state.step
            parts.state.checkpoints += 1  # the loaded checkpoint itself
            self._log.info(f"resuming from step {step}", resumed_from_step=step,
                           file=manager.path(step), epoch=parts.sampler.epoch,
                           position=parts.sampler.position)
            self._match_threads(parts.state.saved_threads, step)
        else:
            step = 0
            self._log.info("no checkpoint found; starting from step 0", resumed_from_step=0)
        lost = max(0, reported - step) if reported is not None else 0
        # steps this attempt computes again: up to the highest step any earlier attempt reached
        # (the last one may have been stopped before it got back to an earlier one's step)
        self._high_water_step = max(highest or 0, step)
        self.goodput.restore(restore_start, time.time(), step, self._high_water_step - step)
        identity = self.config.identity
        entry = {
            "execution": identity.execution, "attempt": identity.task_attempt,
            "task_index": identity.task_index, "resumed_from_step": step, "lost_steps": lost,
        }
        parts.state.history.append(entry)
        self._attempts = record_attempt(self._storage, self.config.namespace, {**entry, "started_at": utc_now()})
        if lost:
            self._log.warning(f"lost {lost} steps of work since the last checkpoint",
                              lost_steps=lost, last_reported_step=reported, resumed_from_step=step)

    def _match_threads(self, saved: int | None, step: int) -> None:
        """Train on with the intra-op thread count the checkpoint was written with.

        On CPU, torch's matrix products split their work by the number of intra-op threads,
        and outside oneMKL's strict reproducibility mode (``MKL_CBWR=AUTO,STRICT``, which the
        CLI sets unless ``MKL_CBWR`` is set) the split changes the order of the floating-point
        sums: with ``--hidden 1024``, 1 and 2 threads give different products. The default
        count comes from the machine and from ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``, which a
        retry may not share; so without ``--threads`` a resumed attempt uses the recorded
        count, and an explicit ``--threads`` that differs from it is obeyed with a warning: the
        run may then end with other hashes than an uninterrupted one.

        :param saved: the thread count in the loaded ``train_state`` (``None``: not recorded).
        :param step: the resumed step, for the log.
        """
        current = torch.get_num_threads()
        if saved is None or saved == current:
            return
        if self.config.train.threads is None:
            torch.set_num_threads(saved)
            self._log.info(f"using {saved} intra-op threads, as the checkpoint of step {step} was written with",
                           threads=saved, default_threads=current)
        else:
            self._log.warning(
                f"--threads {current} differs from the {saved} threads the checkpoint of step {step} was "
                "written with: the result may not be bit-identical to an uninterrupted run",
                threads=current, checkpoint_threads=saved,
            )

    def _train_step(self, parts: Components, data: Dataset) -> float:
        indices = parts.sampler.next_indices().to(data.x_train.device)
        parts.optimizer.zero_grad(set_to_none=True)
        logits = parts.model(data.x_train[indices])
        loss = nn.functional.cross_entropy(logits, data.y_train[indices])
        value = float(loss.item())
        if not math.isfinite(value):
            raise DivergedError(f"training diverged: the loss is {value} at step {parts.state.step + 1} "
                                f"(lower --lr, or check the input data)")
        loss.backward()
        parts.optimizer.step()
        parts.lr_scheduler.step()
        return value

    def _train_loop(self, manager: ckpt.CheckpointManager, parts: Components, data: Dataset,
                    progress: ProgressReporter) -> int:
        state, delay = parts.state, self.config.train.step_delay
        parts.model.train()
        while state.step < self.config.train.steps:
            if self._watcher.requested:
                return self._on_stop(manager, parts, progress)
            self.goodput.first_step()
            began = time.monotonic()
            state.observe(self._train_step(parts, data))
            state.step += 1
            computed = time.monotonic() - began
            self._save(manager, parts, state.step)
            progress.update(state.step, state.loss_ema)  # at most once a second, saves or not
            if delay:
                waited = time.monotonic()
                self._watcher.wait(delay)
                computed += time.monotonic() - waited
            self.goodput.step(computed)
        return EXIT_OK

    def _save(self, manager: ckpt.CheckpointManager, parts: Components, step: int,
              force: bool = False) -> bool:
        """Save through ``manager``; a failed save is logged and training goes on, until the
        manager ends the attempt (too many failed in a row: exit 74 for want of space, else 1;
        see :class:`~gpu_resilience_worker.checkpoint.CheckpointManager`)."""
        began = time.monotonic()
        try:
            saved = manager.save(step, force=force)
        except ckpt.CheckpointSaveError as exc:
            self.goodput.save(time.monotonic() - began, saved=False)
            self._log.error("checkpoint save failed; training goes on", step=step, error=str(exc),
                            failed_in_a_row=manager.failed_in_a_row, failed_saves=manager.failed_saves)
            return False
        self.goodput.save(time.monotonic() - began, saved=saved)
        if saved:  # the previous background save, if any, committed too
            parts.state.checkpoints += 1
        self._failed_total = manager.failed_saves
        return saved

    def _settle_in_flight(self, manager: ckpt.CheckpointManager, step: int) -> bool:
        """Finish (or, out of time, abandon) a background save. :return: whether to go on."""
        began = time.monotonic()
        try:
            return self._settle(manager, step)
        finally:
            self.goodput.save(time.monotonic() - began, saved=False)

    def _settle(self, manager: ckpt.CheckpointManager, step: int) -> bool:
        try:
            if manager.wait_until_finished(timeout=max(0.0, self._watcher.remaining_grace() - 1.0)):
                return True
        except RuntimeError as exc:
            self._log.error("background checkpoint save failed", error=str(exc), step=step)
            return True
        self._log.warning("abandoning the checkpoint save in flight: no time left", step=step)
        manager.abandon()
        return False

    def _on_stop(self, manager: ckpt.CheckpointManager, parts: Components,
                 progress: ProgressReporter) -> int:
        step, watcher = parts.state.step, self._watcher
        self._log.warning(f"{watcher.signal_name} received; stopping at step {step}",
                          signal=watcher.signal_name, step=step,
                          remaining_grace_seconds=round(watcher.remaining_grace(), 3))
        if self._settle_in_flight(manager, step):
            self._final_save(manager, parts, step)
        progress.update(step, parts.state.loss_ema, status="preempted", force=True,
                        max_wait=watcher.remaining_grace() - 1.0)
        self._log.warning("exiting: interrupted, resumable", exit_code=EXIT_PREEMPTED, step=step,
                          last_checkpoint_step=manager.last_saved_step)
        return EXIT_PREEMPTED

    def _final_save(self, manager: ckpt.CheckpointManager, parts: Components, step: int) -> None:
        """Best-effort synchronous save at ``step`` where :func:`decide_stop` says so."""
        watcher = self._watcher
        decision = decide_stop(requested=True, step=step, last_committed=manager.last_saved_step,
                               estimated_save_seconds=manager.estimated_save_seconds,
                               remaining_grace=watcher.remaining_grace(), mode=self.config.preemption_save,
                               checkpointing=self.config.checkpoint.enabled)
        self._log.info(decision.reason, step=step, action=decision.action,
                       estimated_save_seconds=round(manager.estimated_save_seconds, 4),
                       remaining_grace_seconds=round(watcher.remaining_grace(), 3))
        if decision.action == SAVE:
            self._save(manager, parts, step, force=True)

    def _finish(self, manager: ckpt.CheckpointManager, parts: Components, data: Dataset,
                progress: ProgressReporter) -> None:
        total = self.config.train.steps
        if self.config.checkpoint.enabled:
            try:
                manager.wait_until_finished()
            except ckpt.CheckpointSaveError as exc:
                self._log.error("background checkpoint save failed", error=str(exc), step=total)
            if not self._save(manager, parts, total, force=True) and manager.last_saved_step != total:
                raise ckpt.CheckpointSaveError(f"the final checkpoint of step {total} was not written")
        metrics = self.final_metrics(parts, data)
        write_json(self._storage, self._path(METRICS), metrics)
        progress.update(total, parts.state.loss_ema, status="completed", force=True)
        self._log.info("training complete",
                       **{k: v for k, v in metrics.items() if k not in ("history", "attempts")})

    def final_metrics(self, parts: Components, data: Dataset) -> dict[str, Any]:
        """:return: the ``metrics.json`` content."""
        return {
            "accuracy": evaluate(parts.model, data.x_test, data.y_test),
            "test_samples": int(data.y_test.shape[0]),
            "steps": parts.state.step,
            "total_steps": self.config.train.steps,
            "final_loss": parts.state.loss_ema,
            "settings": self.config.train.fingerprint(),
            "wall_seconds": round(parts.state.elapsed_seconds, 3),
            "attempt_wall_seconds": round(time.monotonic() - self._started, 3),
            "checkpoints_written": parts.state.checkpoints,
            "failed_saves": self._failed_total,
            "history": parts.state.history,
            "attempts": self._attempts,
            "lost_steps_total": sum(int(a.get("lost_steps", 0)) for a in self._attempts),
            "model_sha256": state_digest(parts.model.state_dict()),
            "optimizer_sha256": state_digest(parts.optimizer.state_dict()),
        }

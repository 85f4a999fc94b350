"""Lightning ``Trainer.fit`` checkpoints through the commit protocol, with the preemption rules.

Install with the extra: ``pip install './worker[lightning]'``. Use::

    callback = CommitCheckpoint("checkpoints", every_n_steps=50)
    trainer = lightning.Trainer(max_steps=1000, callbacks=[callback], enable_checkpointing=False)
    trainer.fit(model, ResumableLoader(dataset, batch_size=32, seed=0), ckpt_path=callback.latest())

An adapter of :class:`~gpu_resilience_worker.artifacts.ArtifactCheckpoints`: it commits ``step-<step>.ckpt``,
resumes from the newest verified one with the RNG states it keeps in its own state, replaces Lightning's SIGTERM
handler (whose ``SIGTERMException`` exits 0 in Lightning 2.6) by the stop decision, raising ``SystemExit(143)``,
and records the attempt. The rules in full: ``docs/your-code.rst``."""

from __future__ import annotations

import random
import sys
from typing import Any, Iterator

import torch
from lightning.pytorch import Callback

from gpu_resilience_worker.artifacts import ArtifactCheckpoints
from gpu_resilience_worker.errors import EXIT_OK, check_number
from gpu_resilience_worker.logs import StructuredLogger

PREFIX, SUFFIX = "step-", ".ckpt"


def _warm_up_save_path(folder: str) -> None:
    """Run now, not in the grace period of a first save after SIGTERM, the imports Lightning's first save does lazily:
    ``lightning.fabric.utilities.cloud_io._atomic_save`` asks at every save whether the file system is object
    storage, importing ``adlfs``, ``gcsfs`` and ``s3fs`` when installed (seconds of CPU). Skipped when that
    private helper moved."""
    try:
        from lightning.fabric.utilities.cloud_io import _is_object_storage, get_filesystem

        _is_object_storage(get_filesystem(folder))
    except Exception:  # noqa: BLE001 - an optimisation only
        pass


class CommitCheckpoint(Callback):
    """A Lightning ``Callback`` that writes committed checkpoints and handles SIGTERM.

    :param dirpath: the checkpoint folder (a local or FUSE-mounted path).
    :param every_n_steps: save every this many optimizer steps (> 0).
    :param keep_latest_k: committed checkpoints to keep (>= 2); default 2.
    :param grace_seconds: SIGTERM to SIGKILL, in seconds; default ``PREEMPTION_GRACE_SECONDS`` or 10.
    :param logger: structured logger; default one on stdout.
    :raises ValueError: for ``every_n_steps`` <= 0, ``keep_latest_k`` < 2, ``grace_seconds`` <= 0 or an empty
        ``dirpath``."""

    def __init__(self, dirpath: str, every_n_steps: int, keep_latest_k: int = 2,
                 grace_seconds: float | None = None, logger: StructuredLogger | None = None) -> None:
        check_number("every_n_steps", every_n_steps, minimum=0, integer=True, strict=True)
        self.every_n_steps = every_n_steps
        self.checkpoints = ArtifactCheckpoints(dirpath, prefix=PREFIX, suffix=SUFFIX, keep_latest_k=keep_latest_k,
                                               grace_seconds=grace_seconds, logger=logger)

    def latest(self) -> str | None:
        """:return: the newest committed, verified checkpoint file, or ``None`` (for ``ckpt_path``)."""
        return self.checkpoints.latest()

    # set-up ------------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Record SIGTERM from now on; delete uncommitted checkpoints (global rank 0)."""
        if stage != "fit":
            return
        if trainer.is_global_zero:
            self.checkpoints.cleanup_uncommitted()
        self.checkpoints.watcher.install()
        _warm_up_save_path(self.checkpoints.folder)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Put the callback's SIGTERM handler in place of the one Lightning installed at fit start; record the
        attempt (Lightning restored its checkpoint by now)."""
        watcher = self.checkpoints.watcher
        watcher.uninstall()
        watcher.install()
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and connector.received_sigterm:  # arrived while Lightning's handler ran alone
            connector.received_sigterm = False
            watcher._handle(15, None)
        if trainer.is_global_zero:
            self.checkpoints.begin_attempt(trainer.global_step, _total_steps(trainer))
        self.checkpoints.log.info("training started", step=trainer.global_step, max_steps=trainer.max_steps)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Restore the signal handlers that were there before ``setup``."""
        if stage == "fit":
            self.checkpoints.watcher.uninstall()

    # RNG states travel in the callback's state (Lightning's checkpoint has none) ------------------
    def state_dict(self) -> dict[str, Any]:
        """:return: the RNG states: torch CPU (and CUDA), Python ``random``, NumPy when imported."""
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        if "numpy" in sys.modules:  # as plain ints: Lightning loads checkpoints with weights_only=True
            kind, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
            state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the RNG states of :meth:`state_dict`."""
        torch.set_rng_state(state_dict["torch"])
        random.setstate(state_dict["python"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state_dict["cuda"])
        if "numpy" in state_dict and "numpy" in sys.modules:
            numpy = sys.modules["numpy"]
            kind, keys, pos, has_gauss, cached = state_dict["numpy"]
            numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))

    # saves -------------------------------------------------------------------------------------------
    def _save(self, trainer: Any, step: int) -> None:
        if trainer.is_global_zero:
            self.checkpoints.begin_save(step)
        trainer.save_checkpoint(self.checkpoints.path(step))
        if trainer.is_global_zero:
            self.checkpoints.commit(step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Account the step; save on the interval; after SIGTERM, save if it fits and exit 143."""
        step = trainer.global_step
        self.checkpoints.step_done(step)
        action = self.checkpoints.stop_action(step)
        if action == "exit":
            self.checkpoints.exit_preempted(step)
        due = step > 0 and step % self.every_n_steps == 0 and self.checkpoints.last_committed != step
        if action == "save" or due:
            self._save(trainer, step)
        if action == "save" or self.checkpoints.watcher.requested:
            self.checkpoints.exit_preempted(step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Commit the final step when the interval did not; end the attempt's account as complete (``metrics.json``
        gets the scalars the module logged, as ``logged``)."""
        if self.checkpoints.last_committed != trainer.global_step:
            self._save(trainer, trainer.global_step)
        logged = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
        self.checkpoints.end_attempt(trainer.global_step, EXIT_OK, {"logged": logged})


def _total_steps(trainer: Any) -> int:
    """:return: the fit's optimizer steps: ``max_steps``, else Lightning's estimate from the epochs (0 if none)."""
    if trainer.max_steps and trainer.max_steps > 0:
        return int(trainer.max_steps)
    try:
        estimate = float(trainer.estimated_stepping_batches)
    except Exception:  # noqa: BLE001 - an estimate for progress.json only
        return 0
    return int(estimate) if estimate != float("inf") else 0


class ResumableLoader:
    """Batches of a map-style dataset in a seeded order per epoch, resumable at the next batch.

    Lightning saves its ``state_dict`` in every checkpoint and restores it, so a fit resumed mid-epoch continues
    with the batch after the last one trained, in the same order (a plain ``DataLoader`` restarts the epoch). Epoch
    ``e``'s order is ``torch.randperm(len(dataset))`` from a generator seeded with ``seed + e``; each iteration after
    one that yielded a batch is the next epoch. Batches are stacked with ``torch.utils.data.default_collate`` in the
    training process (no workers). The position saved is the batches yielded in the epoch less ``lookahead``:
    Lightning 2.6's loop fetches no batch ahead from a loader with a length (the integration test checks it); a
    consumer that prefetches ``k`` batches needs ``lookahead=k``.

    :param dataset: a map-style dataset (``__len__``, ``__getitem__``).
    :param batch_size: samples per batch (> 0); the last batch may be smaller unless ``drop_last``.
    :param seed: the order's seed; default 0.
    :param shuffle: shuffle each epoch; default true (else the dataset order).
    :param drop_last: drop a last incomplete batch; default false.
    :param lookahead: batches the consumer fetches ahead of the one it trains on; default 0.
    :raises ValueError: for ``batch_size`` <= 0 or ``lookahead`` < 0."""

    def __init__(self, dataset: Any, batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, lookahead: int = 0) -> None:
        check_number("batch_size", batch_size, minimum=0, integer=True, strict=True)
        check_number("lookahead", lookahead, minimum=0, integer=True)
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.shuffle, self.drop_last, self.lookahead = shuffle, drop_last, lookahead
        self.epoch, self._yielded, self._skip, self._started = 0, 0, 0, False

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        return torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def __iter__(self) -> Iterator[Any]:
        if self._started:  # the iteration after one that began: the next epoch
            self.epoch, start = self.epoch + 1, 0
        else:  # the first one, or the first after load_state_dict
            start = self._skip
        self._started, self._skip, self._yielded = True, 0, start
        order = self._order(self.epoch)
        for index in range(start, len(self)):
            items = order[index * self.batch_size:(index + 1) * self.batch_size]
            self._yielded = index + 1
            yield torch.utils.data.default_collate([self.dataset[i] for i in items])

    def state_dict(self) -> dict[str, int]:
        """:return: ``{"epoch", "position"}``: the epoch and the batches of it consumed."""
        return {"epoch": self.epoch, "position": max(self._yielded - self.lookahead, 0)}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resume at batch ``position`` of ``epoch`` (the next epoch when it was complete)."""
        epoch, position = int(state_dict["epoch"]), int(state_dict["position"])
        if position >= len(self):
            epoch, position = epoch + 1, 0
        self.epoch, self._skip, self._yielded, self._started = epoch, position, position, False

"""The bundled trainer's training: the digits MLP, its data and its step, run by
:class:`~gpu_resilience_worker.loop.ResilientLoop` (resume, checkpoints, the stop, the task
folder's files are the loop's, as for any own loop)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import torch
from torch import nn

from gpu_resilience_trainer.config import WorkerConfig
from gpu_resilience_trainer.data import Dataset, EpochSampler, load_dataset
from gpu_resilience_worker import checkpoint as ckpt
from gpu_resilience_worker.errors import ConfigError, DivergedError
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.loop import ResilientLoop
from gpu_resilience_worker.preemption import PreemptionWatcher
from gpu_resilience_worker.state import TrainState, state_digest
from gpu_resilience_worker.storage import Storage


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
        """:return: the checkpoint items besides ``train_state`` (the loop's own, checked first)."""
        return {ckpt.MODEL: self.model, ckpt.OPTIMIZER: self.optimizer, ckpt.LR_SCHEDULER: self.lr_scheduler,
                ckpt.DATALOADER: self.sampler}


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


def run(config: WorkerConfig, logger: StructuredLogger, watcher: PreemptionWatcher, storage: Storage | None = None,
        *, argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run one attempt of the bundled trainer: build the run from the seed, then train it through
    :class:`~gpu_resilience_worker.loop.ResilientLoop` with the flags' settings.

    :param config: the validated configuration.
    :param logger: structured logger.
    :param watcher: the installed preemption watcher.
    :param storage: storage backend; default local files.
    :param argv: the trainer's arguments, which a ``FATAL`` marker is tied to; default none.
    :param env: the environment (the task identity); default ``os.environ``.
    :return: the exit code of :meth:`ResilientLoop.run` (0 done, 143 interrupted, ...).
    :raises ConfigError: bad settings. :raises DataError: bad data (both before training).
    """
    train, checkpoint = config.train, config.checkpoint
    configure_torch(train.threads)
    device = select_device(train.device)
    data = load_dataset(config.data_path)
    data = Dataset(*(t.to(device) for t in dataclasses.astuple(data)))
    parts = build_components(config, data, device)
    logger.info(
        "training setup", device=str(device), lr=train.lr, hidden=train.hidden, sweep_member=config.sweep_member,
        task_count=config.identity.task_count, checkpoint_every_steps=checkpoint.interval or None,
        checkpoint_every_seconds=checkpoint.interval_seconds or None, checkpoint_interval_auto=checkpoint.auto_interval,
        checkpointing=checkpoint.enabled, save_mode=checkpoint.async_mode.value, preemption_save=config.preemption_save,
        threads=torch.get_num_threads(), mkl_cbwr=os.environ.get("MKL_CBWR"), mkl_dynamic=os.environ.get("MKL_DYNAMIC"),
        omp_dynamic=os.environ.get("OMP_DYNAMIC"),
    )
    loop = ResilientLoop(
        parts.stateful(), total_steps=train.steps, folder=config.namespace, checkpoint_every=checkpoint.interval,
        checkpoint_every_seconds=checkpoint.interval_seconds, auto_interval=checkpoint.auto_interval,
        mtbi_seconds=checkpoint.mtbi_seconds, keep_latest_k=checkpoint.keep_latest_k,
        async_save=checkpoint.async_mode is not ckpt.AsyncMode.DISABLED, preemption_save=config.preemption_save,
        grace_seconds=config.timing.grace_seconds, task_timeout_seconds=config.timing.task_timeout_seconds,
        watcher=watcher, logger=logger, storage=storage, env=env, argv=list(argv or []), input_path=config.data_path,
        progress_interval=config.progress_interval, checkpointing=checkpoint.enabled, threads=train.threads,
        train_state=parts.state,
    )
    parts.model.train()

    def step(done: int) -> float:
        indices = parts.sampler.next_indices().to(data.x_train.device)
        parts.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(parts.model(data.x_train[indices]), data.y_train[indices])
        value = float(loss.item())
        if not math.isfinite(value):
            raise DivergedError(f"training diverged: the loss is {value} at step {done + 1} "
                                f"(lower --lr, or check the input data)")
        loss.backward()
        parts.optimizer.step()
        parts.lr_scheduler.step()
        if train.step_delay:
            loop.wait(train.step_delay)
        return value

    def final_metrics() -> dict[str, Any]:  # the held-out accuracy and the final states' digests
        return {"accuracy": evaluate(parts.model, data.x_test, data.y_test), "test_samples": int(data.y_test.shape[0]),
                "model_sha256": state_digest(parts.model.state_dict()),
                "optimizer_sha256": state_digest(parts.optimizer.state_dict())}

    return loop.run(step, final_metrics)

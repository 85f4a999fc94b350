"""The bundled trainer's configuration: its flags and the Cloud Run environment, validated into a
:class:`WorkerConfig`; anything invalid is a :class:`~gpu_resilience_worker.errors.ConfigError` (exit 78)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Mapping, Sequence

from gpu_resilience_worker.config import MAX_SECONDS, StopTiming, TaskIdentity, root_and_namespace
from gpu_resilience_worker.errors import ConfigError
from gpu_resilience_worker.policies import AsyncMode, CheckpointConfig
from gpu_resilience_worker.preemption import PREEMPTION_SAVES

#: Hyper-parameter sweep of multi-task executions: with ``CLOUD_RUN_TASK_COUNT`` > 1 (and
#: ``--sweep auto``), task ``i`` trains member ``i mod len(SWEEP)``, replacing ``--lr`` and
#: ``--hidden``. A grid of learning rate x hidden units.
SWEEP: tuple[dict[str, float | int], ...] = (
    {"lr": 3e-3, "hidden": 128},
    {"lr": 1e-3, "hidden": 128},
    {"lr": 3e-3, "hidden": 256},
    {"lr": 1e-3, "hidden": 256},
)
DEFAULT_DATA = "data/digits.npz"
#: The most torch intra-op threads ``--threads`` accepts: OpenMP crashed (SIGSEGV, no message)
#: at 100000; no machine Cloud Run offers has a tenth of this many cores.
MAX_THREADS = 1024


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters and pacing of the training run.

    :param steps: total optimizer steps; default 600.
    :param batch_size: samples per batch; default 64.
    :param lr: peak learning rate of Adam (cosine decay to 0); default 0.003.
    :param hidden: hidden units in each of the two MLP layers; default 128.
    :param dropout: dropout probability; default 0.1.
    :param seed: seed of initialization, dropout and data order; default 0.
    :param step_delay: seconds to sleep after each step (demos of preemption); default 0.
    :param device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
    :param threads: torch CPU threads; default torch's (on resume: the count recorded in the checkpoint).
    """

    steps: int = 600
    batch_size: int = 64
    lr: float = 3e-3
    hidden: int = 128
    dropout: float = 0.1
    seed: int = 0
    step_delay: float = 0.0
    device: str = "auto"
    threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be in [0, 2**63), got {self.seed}")
        if not 0 <= self.step_delay <= 3600:
            raise ValueError(f"--step-delay must be in [0, 3600] seconds, got {self.step_delay}")
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            raise ValueError(f"--threads must be in [1, {MAX_THREADS}], got {self.threads}")

    def fingerprint(self) -> dict[str, object]:
        """:return: the settings that a checkpoint must have been written with to be resumed."""
        keys = ("steps", "batch_size", "lr", "hidden", "dropout", "seed")
        return {key: getattr(self, key) for key in keys}


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything one attempt needs.

    :param train: hyperparameters.
    :param checkpoint: checkpoint manager settings (``folder`` is the namespace).
    :param identity: the Cloud Run task identity.
    :param data_path: the ``.npz`` input file (absolute).
    :param timing: the grace period and the attempt's timeout (:class:`StopTiming`).
    :param progress_interval: minimum seconds between ``progress.json`` writes; default 1.
    :param preemption_save: one of :data:`PREEMPTION_SAVES`; default ``deadline``. With
        checkpointing off (``--checkpoint-every 0``) nothing is saved at a stop either.
    :param sweep_member: the :data:`SWEEP` member this task trains, or ``None``.
    """

    train: TrainConfig
    checkpoint: CheckpointConfig
    identity: TaskIdentity
    data_path: str
    timing: StopTiming = StopTiming()
    progress_interval: float = 1.0
    preemption_save: str = "deadline"
    sweep_member: int | None = None

    @property
    def namespace(self) -> str:
        """The task's checkpoint folder."""
        return self.checkpoint.folder


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are configuration errors (exit 78)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"invalid arguments: {message}")


def build_parser() -> argparse.ArgumentParser:
    """:return: the ``python -m gpu_resilience_trainer`` argument parser."""
    parser = _Parser(prog="python -m gpu_resilience_trainer",
                     description="The bundled digits trainer: train (or resume) a small MLP, checkpointing "
                                 "to the task folder, on the library gpu_resilience_worker.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = commands.add_parser("train", help="train (or resume) the digits MLP")
    defaults = TrainConfig()
    add = train.add_argument
    add("--data", default=DEFAULT_DATA, help="input .npz; relative paths resolve against the root")
    add("--checkpoint-dir", default=None, help="checkpoint root; else $CHECKPOINT_DIR, else /checkpoints")
    add("--run-id", default=None, help="extra namespace level; else $CHECKPOINT_RUN_ID")
    add("--steps", type=int, default=defaults.steps, help="total optimizer steps")
    add("--batch-size", type=int, default=defaults.batch_size)
    add("--lr", type=float, default=defaults.lr, help="peak learning rate (cosine decay)")
    add("--hidden", type=int, default=defaults.hidden, help="hidden units per layer")
    add("--dropout", type=float, default=defaults.dropout)
    add("--seed", type=int, default=defaults.seed)
    add("--checkpoint-every", type=int, default=50,
        help="steps between checkpoints; 0: no checkpoints at all (not even at a stop)")
    add("--checkpoint-interval", default=None, metavar="N|Ns|auto",
        help="N steps, N seconds ('30s'), or 'auto' (Young/Daly); overrides --checkpoint-every")
    add("--mtbi", type=float, default=3600.0,
        help="mean time between interruptions, seconds, for --checkpoint-interval auto")
    add("--keep", type=int, default=2, help="valid checkpoints to keep (>= 2)")
    mode = train.add_mutually_exclusive_group()
    mode.add_argument("--async-save", dest="sync_save", action="store_false",
                      help="interval checkpoints on a background thread (the default)")
    mode.add_argument("--sync-save", dest="sync_save", action="store_true",
                      help="interval checkpoints on the training thread")
    train.set_defaults(sync_save=False)
    add("--preemption-save", choices=PREEMPTION_SAVES, default="deadline",
        help="checkpoint at SIGTERM/deadline: if it fits (deadline), always, or never")
    add("--sweep", choices=("auto", "off"), default="auto",
        help="auto: with CLOUD_RUN_TASK_COUNT > 1 task i trains sweep member i mod 4")
    add("--step-delay", type=float, default=0.0, help="seconds to sleep per step (demos)")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add("--threads", type=int, default=None,
        help="torch CPU threads; default torch's, or on resume the count the checkpoint was written with")
    add("--progress-interval", type=float, default=1.0, help="min seconds between progress.json writes")
    return parser


def guess_namespace(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """Best-effort namespace for a ``FATAL`` marker when the full configuration is invalid.

    :return: the namespace, or ``None`` when even that cannot be worked out.
    """
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--checkpoint-dir")
    probe.add_argument("--run-id")
    try:
        known, _ = probe.parse_known_args(list(argv))
        return root_and_namespace(known.checkpoint_dir, known.run_id, env, TaskIdentity.from_env(env))[1]
    except (ConfigError, SystemExit):
        return None


def parse_interval(spec: str | None, every: int) -> dict[str, object]:
    """Turn ``--checkpoint-interval`` (or ``--checkpoint-every``) into checkpoint settings.

    :param spec: ``N`` steps, ``Ns`` seconds, ``auto``, or ``None`` to use ``every``.
    :param every: ``--checkpoint-every`` steps (0: never).
    :return: ``interval``, ``interval_seconds`` and ``auto_interval`` for :class:`CheckpointConfig`.
    :raises ConfigError: when ``spec`` is none of these.
    """
    settings: dict[str, object] = {"interval": every, "interval_seconds": 0.0, "auto_interval": False}
    if spec is None:
        return settings
    text = spec.strip().lower()
    try:
        if text == "auto":
            return {**settings, "interval": 0, "auto_interval": True}
        if text.endswith("s"):
            seconds = float(text[:-1])
            if not 0 < seconds <= MAX_SECONDS:
                raise ValueError
            return {**settings, "interval": 0, "interval_seconds": seconds}
        return {**settings, "interval": int(text)}
    except ValueError:
        raise ConfigError(f"--checkpoint-interval {spec!r}: expected N (steps), Ns (seconds, at most "
                          f"{MAX_SECONDS:g}) or auto") from None


def sweep_member(identity: TaskIdentity, mode: str) -> int | None:
    """:return: the :data:`SWEEP` member of this task, or ``None`` for a single-task run."""
    if mode == "off" or identity.task_count <= 1:
        return None
    return identity.task_index % len(SWEEP)


def config_from_args(argv: Sequence[str], env: Mapping[str, str]) -> WorkerConfig:
    """Parse flags and environment into a validated :class:`WorkerConfig`.

    :raises ConfigError: on any invalid flag or variable.
    """
    args = build_parser().parse_args(list(argv))
    identity = TaskIdentity.from_env(env)
    root, namespace = root_and_namespace(args.checkpoint_dir, args.run_id, env, identity)
    member = sweep_member(identity, args.sweep)
    hyper = SWEEP[member] if member is not None else {"lr": args.lr, "hidden": args.hidden}
    try:
        train = TrainConfig(
            steps=args.steps, batch_size=args.batch_size, lr=float(hyper["lr"]),
            hidden=int(hyper["hidden"]), dropout=args.dropout, seed=args.seed,
            step_delay=args.step_delay, device=args.device, threads=args.threads,
        )
        checkpoint = CheckpointConfig(
            folder=namespace, keep_latest_k=args.keep, mtbi_seconds=args.mtbi,
            **parse_interval(args.checkpoint_interval, args.checkpoint_every),  # type: ignore[arg-type]
            async_mode=AsyncMode.DISABLED if args.sync_save else AsyncMode.ASYNC,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not 0 <= args.progress_interval <= MAX_SECONDS:
        raise ConfigError(f"--progress-interval must be in [0, {MAX_SECONDS:g}] seconds, got {args.progress_interval}")
    return WorkerConfig(
        train=train, checkpoint=checkpoint, identity=identity,
        data_path=os.path.join(root, args.data),
        timing=StopTiming.from_env(env),
        progress_interval=args.progress_interval, preemption_save=args.preemption_save,
        sweep_member=member,
    )

"""Configuration from flags and the Cloud Run environment; validation maps to exit 78."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from typing import Any, Mapping, Sequence

from gpu_resilience_worker.errors import ConfigError
from gpu_resilience_worker.policies import AsyncMode, CheckpointConfig
from gpu_resilience_worker.preemption import DEFAULT_GRACE_SECONDS, PREEMPTION_SAVES, PreemptionWatcher, set_task_deadline

#: Hyper-parameter sweep of multi-task executions: with ``CLOUD_RUN_TASK_COUNT`` > 1 (and
#: ``--sweep auto``), task ``i`` trains member ``i mod len(SWEEP)``, replacing ``--lr`` and
#: ``--hidden``. A grid of learning rate x hidden units.
SWEEP: tuple[dict[str, float | int], ...] = (
    {"lr": 3e-3, "hidden": 128},
    {"lr": 1e-3, "hidden": 128},
    {"lr": 3e-3, "hidden": 256},
    {"lr": 1e-3, "hidden": 256},
)
DEFAULT_ROOT = "/checkpoints"
DEFAULT_DATA = "data/digits.npz"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


#: The largest number of seconds a duration variable may say: Cloud Run's longest task timeout
#: (168 hours). Beyond it a wait overflows the platform's timestamps (``inf``, ``1e300``).
MAX_SECONDS = 604800.0
#: The most torch intra-op threads ``--threads`` accepts: OpenMP crashed (SIGSEGV, no message)
#: at 100000; no machine Cloud Run offers has a tenth of this many cores.
MAX_THREADS = 1024


def _env_number(env: Mapping[str, str], name: str, default: float | None, *, integer: bool = False,
                minimum: float = 0, strict: bool = False) -> float | None:
    """:return: the variable ``name`` as an int (``integer``) or a number of seconds in
    [``minimum``, :data:`MAX_SECONDS`] (above ``minimum`` when ``strict``), ``default`` when unset or
    empty. :raises ConfigError: naming the variable, its value and the range."""
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not {'an integer' if integer else 'a number'}") from None
    if integer and value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    if not integer and not ((value > minimum if strict else value >= minimum) and value <= MAX_SECONDS):
        raise ConfigError(f"{name}={raw!r} must be a number of seconds {'>' if strict else '>='} {minimum:g} "
                          f"and <= {MAX_SECONDS:g}")  # also refuses nan
    return value


@dataclasses.dataclass(frozen=True)
class StopTiming:
    """The grace period and the attempt's timeout: the one parse of ``PREEMPTION_GRACE_SECONDS``
    and ``TASK_TIMEOUT_SECONDS`` (the worker <-> platform contract), for every way in.

    :param grace_seconds: SIGTERM to SIGKILL, seconds; default 10.
    :param task_timeout_seconds: the attempt's timeout, seconds, counted from the process's start;
        ``None``: no deadline.
    """

    grace_seconds: float = DEFAULT_GRACE_SECONDS
    task_timeout_seconds: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, grace_seconds: float | None = None,
                 task_timeout_seconds: float | None = None) -> StopTiming:
        """A value given here wins over the environment's.

        :param env: the environment; default ``os.environ``.
        :param grace_seconds: the grace period, when the caller fixes it (already checked).
        :param task_timeout_seconds: the timeout, when the caller fixes it (already checked).
        :raises ConfigError: ``PREEMPTION_GRACE_SECONDS`` not a number of seconds in
            [0, :data:`MAX_SECONDS`], or ``TASK_TIMEOUT_SECONDS`` set but not in (0, :data:`MAX_SECONDS`].
        """
        env = os.environ if env is None else env
        grace = _env_number(env, "PREEMPTION_GRACE_SECONDS", DEFAULT_GRACE_SECONDS) if grace_seconds is None \
            else grace_seconds
        timeout = _env_number(env, "TASK_TIMEOUT_SECONDS", None, strict=True) if task_timeout_seconds is None \
            else task_timeout_seconds
        return cls(float(grace), None if timeout is None else float(timeout))

    def apply(self, watcher: PreemptionWatcher) -> None:
        """Give ``watcher`` this grace period and deadline (:func:`set_task_deadline`)."""
        watcher.grace_seconds = self.grace_seconds
        set_task_deadline(watcher, self.task_timeout_seconds)


def _safe_name(value: str, what: str) -> str:
    if not _SAFE_NAME.match(value) or value in (".", ".."):
        raise ConfigError(f"{what} {value!r} is not a safe path component ([A-Za-z0-9._-], max 128)")
    return value


@dataclasses.dataclass(frozen=True)
class TaskIdentity:
    """Who this process is, from the ``CLOUD_RUN_*`` variables.

    :param job: ``CLOUD_RUN_JOB``; default ``local``.
    :param execution: ``CLOUD_RUN_EXECUTION``; default empty.
    :param task_index: ``CLOUD_RUN_TASK_INDEX``, 0-based; default 0.
    :param task_attempt: ``CLOUD_RUN_TASK_ATTEMPT``, 0-based; default 0.
    :param task_count: ``CLOUD_RUN_TASK_COUNT``; default 1.
    """

    job: str = "local"
    execution: str = ""
    task_index: int = 0
    task_attempt: int = 0
    task_count: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, fallback: bool = False) -> TaskIdentity:
        """:param fallback: the defaults instead of an error when a variable is malformed.

        :raises ConfigError: when a variable is malformed (without ``fallback``).
        """
        try:
            return cls._from_env(env)
        except ConfigError:
            if fallback:
                return cls()
            raise

    @classmethod
    def _from_env(cls, env: Mapping[str, str]) -> TaskIdentity:
        identity = cls(
            job=_safe_name(env.get("CLOUD_RUN_JOB") or "local", "CLOUD_RUN_JOB"),
            execution=_safe_name(env["CLOUD_RUN_EXECUTION"], "CLOUD_RUN_EXECUTION")
            if env.get("CLOUD_RUN_EXECUTION") else "",
            task_index=int(_env_number(env, "CLOUD_RUN_TASK_INDEX", 0, integer=True)),
            task_attempt=int(_env_number(env, "CLOUD_RUN_TASK_ATTEMPT", 0, integer=True)),
            task_count=int(_env_number(env, "CLOUD_RUN_TASK_COUNT", 1, integer=True, minimum=1)),
        )
        if identity.task_index >= identity.task_count:
            raise ConfigError(f"CLOUD_RUN_TASK_INDEX={identity.task_index} >= CLOUD_RUN_TASK_COUNT")
        return identity

    def bind(self, logger: Any) -> Any:
        """
        :return: ``logger`` (a :class:`~gpu_resilience_worker.logs.StructuredLogger`) with this
            identity on every line (``job``, ``execution``, ``task_index``, ``attempt``)."""
        return logger.bind(job=self.job, execution=self.execution, task_index=self.task_index,
                           attempt=self.task_attempt)

    def namespace(self, root: str, run_id: str | None) -> str:
        """:return: ``{root}/{job}[/{run_id}]/task-{index}``."""
        parts = [root.rstrip("/") or "/", self.job] + ([run_id] if run_id else [])
        return os.path.join(*parts, f"task-{self.task_index}")


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
    """:return: the ``python -m gpu_resilience_worker`` argument parser."""
    parser = _Parser(prog="python -m gpu_resilience_worker", description=__doc__)
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
        return _root_and_namespace(known.checkpoint_dir, known.run_id, env, TaskIdentity.from_env(env))[1]
    except (ConfigError, SystemExit):
        return None


def _root_and_namespace(checkpoint_dir: str | None, run_id: str | None, env: Mapping[str, str],
                        identity: TaskIdentity) -> tuple[str, str]:
    """:return: ``(root, namespace)`` from ``--checkpoint-dir`` and ``--run-id`` (``None``: not
    given), else ``CHECKPOINT_DIR`` / ``CHECKPOINT_RUN_ID``, else the defaults.
    :raises ConfigError: for a flag given empty (a template that rendered empty must not fall
        back to the default folder or to no run level), or an unsafe run id."""
    for flag, value in (("--checkpoint-dir", checkpoint_dir), ("--run-id", run_id)):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag} is empty; leave it out for the default, or give a value")
    root = checkpoint_dir or env.get("CHECKPOINT_DIR") or DEFAULT_ROOT
    run_id = run_id or env.get("CHECKPOINT_RUN_ID") or None
    return root, identity.namespace(root, _safe_name(run_id, "run id") if run_id else None)


def task_namespace(env: Mapping[str, str] | None = None, *, root: str | None = None,
                   run_id: str | None = None) -> str:
    """The task's checkpoint folder, as the bundled worker names it.

    ``{root}/{CLOUD_RUN_JOB}[/{run_id}]/task-{CLOUD_RUN_TASK_INDEX}``, with ``root`` defaulting
    to ``$CHECKPOINT_DIR``, else ``/checkpoints``, and ``run_id`` to ``$CHECKPOINT_RUN_ID``
    (none when unset). Outside Cloud Run the job is ``local`` and the index 0.

    :param env: the environment; default ``os.environ``.
    :param root: the checkpoint root (the mounted bucket); overrides ``CHECKPOINT_DIR``.
    :param run_id: an extra namespace level (one per DAG run); overrides ``CHECKPOINT_RUN_ID``.
    :return: the folder path (not created).
    :raises ConfigError: a malformed ``CLOUD_RUN_*`` variable or an unsafe job name or run id.
    """
    env = os.environ if env is None else env
    # an empty root or run id here means "not given", as it always has for this function
    return _root_and_namespace(root or None, run_id or None, env, TaskIdentity.from_env(env))[1]


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
    root, namespace = _root_and_namespace(args.checkpoint_dir, args.run_id, env, identity)
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

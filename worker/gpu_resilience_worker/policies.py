"""When to checkpoint and what to keep: the save and keep policies, their save measurements, and the
:class:`CheckpointConfig` that selects them."""

from __future__ import annotations

import dataclasses
import enum
import errno
import math
from typing import Iterable


#: Checkpoint saves that fail in a row before the attempt ends, in every driver: counted by the checkpoint
#: manager when each save's outcome is known (its commit, or its error), background saves alike.
MAX_FAILED_SAVES_IN_A_ROW = 3
#: ``errno`` values of a file system without room for the checkpoint: ENOSPC, EDQUOT (a quota).
OUT_OF_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
#: :func:`failed_save_verdict`'s answers.
GO_ON, GIVE_UP, OUT_OF_SPACE = "go on", "give up", "out of space"


def failed_save_verdict(failed_in_a_row: int, error: BaseException) -> str:
    """What a failed checkpoint save means for the attempt.

    :param failed_in_a_row: saves failed in a row, this one included (>= 1).
    :param error: this save's error (an ``OSError`` of the write, or any other).
    :return: :data:`GO_ON` below :data:`MAX_FAILED_SAVES_IN_A_ROW` (training goes on without the checkpoint);
        at it, :data:`OUT_OF_SPACE` for an ``OSError`` with an errno of :data:`OUT_OF_SPACE_ERRNOS` (exit 74, not
        retryable), else :data:`GIVE_UP` (exit 1, retryable: EIO and its kind pass)."""
    if failed_in_a_row < MAX_FAILED_SAVES_IN_A_ROW:
        return GO_ON
    if isinstance(error, OSError) and error.errno in OUT_OF_SPACE_ERRNOS:
        return OUT_OF_SPACE
    return GIVE_UP


@dataclasses.dataclass(frozen=True)
class SavePolicy:
    """When to save: every ``steps`` optimizer steps, when ``seconds`` passed since the last save, or at the
    Young/Daly optimum ``sqrt(2 * cost * mtbi)`` seconds after it, whichever is first (a preemption forces one).

    :param steps: steps between checkpoints; default 0 (off).
    :param seconds: wall seconds between checkpoints; default 0 (off).
    :param mtbi: mean time between interruptions for the Young/Daly interval, seconds; default ``None`` (off).
    :param floor: never save more often than this by the Young/Daly interval, in seconds; default 0."""

    steps: int = 0
    seconds: float = 0.0
    mtbi: float | None = None
    floor: float = 0.0

    def interval(self, cost: float) -> float | None:
        """:return: the Young/Daly interval (seconds) for a save of ``cost`` seconds (``None`` without ``mtbi``)."""
        return None if self.mtbi is None else max(math.sqrt(2.0 * max(cost, 0.0) * self.mtbi), self.floor)

    def should_save(self, step: int, elapsed: float = 0.0, cost: float = 0.0) -> bool:
        """Whether a save costing ``cost`` seconds is due at ``step`` (never 0), ``elapsed`` seconds after the last."""
        auto = self.interval(cost)
        return step > 0 and (bool(self.steps) and step % self.steps == 0
                             or bool(self.seconds) and elapsed >= self.seconds or auto is not None and elapsed >= auto)


@dataclasses.dataclass(frozen=True)
class KeepLatestN:
    """Keep the newest ``n`` valid checkpoints.

    :param n: how many valid checkpoints to keep (>= 1 here; the manager requires >= 2)."""

    n: int

    def to_keep(self, valid_steps: Iterable[int]) -> list[int]:
        """:return: the steps to keep, newest first."""
        return sorted(set(valid_steps), reverse=True)[: self.n]

    def to_delete(self, present_steps: Iterable[int], valid_steps: Iterable[int]) -> list[int]:
        """:param present_steps: every step with any file (valid or not).
        :param valid_steps: the steps whose checkpoint is committed and verified.
        :return: the steps to delete, oldest first: only those older than the newest kept one (a checkpoint newer
            than the last valid one may still be being written); none without a valid checkpoint."""
        keep = self.to_keep(valid_steps)
        return sorted(s for s in set(present_steps) if s not in keep and s < keep[0]) if keep else []


class AsyncMode(enum.Enum):
    """How interval checkpoints are written."""

    DISABLED = "disabled"
    """Synchronously, on the training thread."""
    ASYNC = "async"
    """State copied to CPU on the training thread, written and committed on a background thread."""


@dataclasses.dataclass
class CheckpointConfig:
    """Configuration of a :class:`CheckpointManager`.

    :param folder: the task's checkpoint namespace (a plain path string).
    :param interval: save every this many optimizer steps; default 50; 0: no step interval.
    :param keep_latest_k: keep this many valid checkpoints; default 2. 1 is refused: the newest may be incomplete
        when the process is killed, and the previous one must still exist.
    :param async_mode: :attr:`AsyncMode.ASYNC` (default) or :attr:`AsyncMode.DISABLED`.
    :param load_step: step to load, or -1 for the newest valid one.
    :param interval_seconds: also save when this many seconds passed since the last save; default 0 (off).
    :param auto_interval: save at the Young/Daly optimum from the measured save cost and ``mtbi_seconds``;
        default off. With none of the three policies, only forced saves write (:attr:`enabled` is false).
    :param mtbi_seconds: mean time between interruptions for ``auto_interval``, in seconds; default 3600."""

    folder: str
    interval: int = 50
    keep_latest_k: int = 2
    async_mode: AsyncMode = AsyncMode.ASYNC
    load_step: int = -1
    interval_seconds: float = 0.0
    auto_interval: bool = False
    mtbi_seconds: float = 3600.0

    def __post_init__(self) -> None:
        if not self.folder:
            raise ValueError("checkpoint folder must not be empty")
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 0:
            raise ValueError(f"checkpoint interval must be an int >= 0 (0: never), got {self.interval!r}")
        if self.keep_latest_k == 1:
            raise ValueError("keep_latest_k=1 is refused: the newest checkpoint may still be in flight "
                             "when the task is killed, so at least 2 must be kept")
        if not isinstance(self.keep_latest_k, int) or self.keep_latest_k < 2:
            raise ValueError(f"keep_latest_k must be an int >= 2, got {self.keep_latest_k!r}")
        if not isinstance(self.async_mode, AsyncMode):
            raise ValueError(f"async_mode must be an AsyncMode, got {self.async_mode!r}")
        if not isinstance(self.load_step, int) or self.load_step < -1:
            raise ValueError(f"load_step must be -1 or a step >= 0, got {self.load_step!r}")
        if not (self.interval_seconds >= 0 and math.isfinite(self.interval_seconds)):
            raise ValueError(f"checkpoint interval seconds must be finite and >= 0, got {self.interval_seconds!r}")
        if not (self.mtbi_seconds > 0 and math.isfinite(self.mtbi_seconds)):
            raise ValueError(f"--mtbi (mean time between interruptions) must be a finite number of seconds > 0, "
                             f"got {self.mtbi_seconds!r}")

    @property
    def enabled(self) -> bool:
        """Whether any save policy is on (else only forced saves write)."""
        return self.interval > 0 or self.interval_seconds > 0 or self.auto_interval

    def save_policy(self) -> SavePolicy:
        """:return: the configured step, time and Young/Daly policy."""
        return SavePolicy(self.interval, self.interval_seconds, self.mtbi_seconds if self.auto_interval else None)


@dataclasses.dataclass
class SaveStats:
    """Measurements of the saves of one manager (for intervals and deadline decisions).

    :param blocking: seconds the caller was blocked per save (the snapshot, for async saves).
    :param durations: seconds from start to commit per save.
    :param sizes: bytes per save."""

    blocking: list[float] = dataclasses.field(default_factory=list)
    durations: list[float] = dataclasses.field(default_factory=list)
    sizes: list[int] = dataclasses.field(default_factory=list)

    def cost(self, default: float = 1.0) -> float:
        """:return: the median blocking time of the last five saves, seconds (``default`` before any)."""
        recent = sorted(self.blocking[-5:])
        return recent[len(recent) // 2] if recent else default

    def bytes_per_second(self) -> float | None:
        """:return: the slowest write throughput of the last five saves, or ``None``."""
        rates = [size / max(d, 1e-6) for size, d in zip(self.sizes[-5:], self.durations[-5:])]
        return min(rates) if rates else None

    def estimated_seconds(self, default: float = 1.0) -> float:
        """:return: seconds a synchronous save of the last size takes at the measured throughput."""
        rate = self.bytes_per_second()
        return self.sizes[-1] / rate if rate and self.sizes else default

"""When to checkpoint and what to keep: the save and keep policies, the save measurements they
use, and :class:`CheckpointConfig`, which selects them."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Iterable


@dataclasses.dataclass(frozen=True)
class FixedIntervalPolicy:
    """Save every ``interval`` steps.

    :param interval: steps between checkpoints (> 0).
    """

    interval: int

    def should_save(self, step: int, elapsed: float = 0.0, cost: float = 0.0) -> bool:
        """:return: whether ``step`` is a multiple of the interval (``elapsed``, ``cost`` unused)."""
        return step > 0 and step % self.interval == 0


@dataclasses.dataclass(frozen=True)
class TimeIntervalPolicy:
    """Save when ``seconds`` have passed since the last save (or the start).

    :param seconds: wall seconds between checkpoints (> 0).
    """

    seconds: float

    def should_save(self, step: int, elapsed: float = 0.0, cost: float = 0.0) -> bool:
        """:return: whether ``elapsed`` (seconds since the last save) reached the interval."""
        return step > 0 and elapsed >= self.seconds


@dataclasses.dataclass(frozen=True)
class YoungDalyPolicy:
    """Save at the Young/Daly optimum ``sqrt(2 * cost * mtbi)`` seconds after the last save.

    :param mtbi: mean time between interruptions, in seconds (> 0).
    :param floor: never save more often than this, in seconds; default 0.
    """

    mtbi: float
    floor: float = 0.0

    def interval(self, cost: float) -> float:
        """:return: the interval in seconds for a checkpoint costing ``cost`` seconds."""
        return max(math.sqrt(2.0 * max(cost, 0.0) * self.mtbi), self.floor)

    def should_save(self, step: int, elapsed: float = 0.0, cost: float = 0.0) -> bool:
        """:return: whether ``elapsed`` seconds since the last save reached the optimum."""
        return step > 0 and elapsed >= self.interval(cost)


@dataclasses.dataclass(frozen=True)
class AnySavePolicy:
    """Save when any of ``policies`` says so (preemption is a ``force`` on :meth:`save`)."""

    policies: tuple[Any, ...]

    def should_save(self, step: int, elapsed: float = 0.0, cost: float = 0.0) -> bool:
        """:return: whether any policy wants a checkpoint at ``step``."""
        return any(policy.should_save(step, elapsed, cost) for policy in self.policies)


@dataclasses.dataclass(frozen=True)
class KeepLatestN:
    """Keep the newest ``n`` valid checkpoints.

    :param n: how many valid checkpoints to keep (>= 1 here; the manager requires >= 2).
    """

    n: int

    def to_keep(self, valid_steps: Iterable[int]) -> list[int]:
        """:return: the steps to keep, newest first."""
        return sorted(set(valid_steps), reverse=True)[: self.n]

    def to_delete(self, present_steps: Iterable[int], valid_steps: Iterable[int]) -> list[int]:
        """:return: the steps to delete, oldest first.

        Only steps older than the newest kept one are deleted, so a checkpoint newer than the
        last valid one (possibly still being written) is never touched. With no valid checkpoint,
        nothing is deleted.

        :param present_steps: every step with any file (valid or not).
        :param valid_steps: the steps whose checkpoint is committed and verified.
        """
        keep = self.to_keep(valid_steps)
        if not keep:
            return []
        return sorted(s for s in set(present_steps) if s not in keep and s < keep[0])


class AsyncMode(enum.Enum):
    """How interval checkpoints are written."""

    DISABLED = "disabled"
    """Synchronously, on the training thread."""
    ASYNC = "async"
    """State copied to CPU on the training thread, written and committed on a background thread."""
    AUTO = "auto"
    """Each interval save the way its measured cost says is cheaper (see :func:`choose_save_mode`):
    in the background, unless that has cost training more than a save on the training thread.
    The costs are measured per save from the time between :meth:`CheckpointManager.save` calls,
    so call it after every step, as :class:`ResilientLoop` does."""


@dataclasses.dataclass
class CheckpointConfig:
    """Configuration of a :class:`CheckpointManager`.

    :param folder: the task's checkpoint namespace (a plain path string).
    :param interval: save every this many optimizer steps; default 50; 0: no step interval.
    :param keep_latest_k: keep this many valid checkpoints; default 2. 1 is refused: the newest
        may be incomplete when the process is killed, and the previous one must still exist.
    :param async_mode: :attr:`AsyncMode.AUTO` (default), :attr:`AsyncMode.ASYNC` or
        :attr:`AsyncMode.DISABLED`.
    :param load_step: step to load, or -1 for the newest valid one.
    :param interval_seconds: also save when this many seconds passed since the last save;
        default 0 (off).
    :param auto_interval: save at the Young/Daly optimum from the measured save cost and
        ``mtbi_seconds``; default off.
    :param mtbi_seconds: mean time between interruptions for ``auto_interval``, in seconds;
        default 3600.

    With ``interval`` 0, ``interval_seconds`` 0 and no ``auto_interval``, checkpointing is off
    (:attr:`enabled` is false): only forced saves write.
    """

    folder: str
    interval: int = 50
    keep_latest_k: int = 2
    async_mode: AsyncMode = AsyncMode.AUTO
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
            raise ValueError(
                "keep_latest_k=1 is refused: the newest checkpoint may still be in flight "
                "when the task is killed, so at least 2 must be kept"
            )
        if not isinstance(self.keep_latest_k, int) or self.keep_latest_k < 2:
            raise ValueError(f"keep_latest_k must be an int >= 2, got {self.keep_latest_k!r}")
        if not isinstance(self.async_mode, AsyncMode):
            raise ValueError(f"async_mode must be an AsyncMode, got {self.async_mode!r}")
        if not isinstance(self.load_step, int) or self.load_step < -1:
            raise ValueError(f"load_step must be -1 or a step >= 0, got {self.load_step!r}")
        if not self.interval_seconds >= 0:
            raise ValueError(f"checkpoint interval seconds must be >= 0, got {self.interval_seconds!r}")
        if not self.mtbi_seconds > 0:
            raise ValueError(f"mean time between interruptions must be > 0 s, got {self.mtbi_seconds!r}")

    @property
    def enabled(self) -> bool:
        """Whether any save policy is on (else only forced saves write)."""
        return self.interval > 0 or self.interval_seconds > 0 or self.auto_interval

    def save_policy(self) -> AnySavePolicy:
        """:return: the combination of the configured step, time and Young/Daly policies."""
        policies: list[Any] = []
        if self.interval:
            policies.append(FixedIntervalPolicy(self.interval))
        if self.interval_seconds:
            policies.append(TimeIntervalPolicy(self.interval_seconds))
        if self.auto_interval:
            policies.append(YoungDalyPolicy(self.mtbi_seconds))
        return AnySavePolicy(tuple(policies))


@dataclasses.dataclass
class SaveStats:
    """Measurements of the saves of one manager (for intervals and deadline decisions).

    :param blocking: seconds the caller was blocked per save (the snapshot, for async saves).
    :param durations: seconds from start to commit per save.
    :param sizes: bytes per save.
    """

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


def _median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


#: Consecutive synchronous interval saves after which :attr:`AsyncMode.AUTO` measures a
#: background save again (the load of the machine, the volume's bandwidth may have changed).
REMEASURE_AFTER = 8


def choose_save_mode(async_costs: list[float], sync_costs: list[float], syncs_in_a_row: int, *,
                     remeasure_after: int = REMEASURE_AFTER) -> AsyncMode:
    """Decide how the next interval save of :attr:`AsyncMode.AUTO` is written.

    A background save costs the training loop its blocking host copy, any wait for it at the
    next save, and the time training steps lost while it ran (they share the CPUs with it); a
    save on the training thread costs its whole duration. Where training leaves no core idle
    and the write is bound by the CPU (a page cache, a local disk at memory speed), the
    background save costs more: the copy comes on top of the same work. Where the write waits
    for a device or a network, or a core is free (GPU training), it costs a fraction.

    :param async_costs: measured costs of background saves, seconds, oldest first.
    :param sync_costs: measured durations of saves on the training thread, and estimates of
        them from background saves (the background thread's time minus its time spent waiting
        for a CPU), seconds, oldest first.
    :param syncs_in_a_row: synchronous interval saves since the last background one.
    :param remeasure_after: after this many synchronous saves in a row, one background save
        measures its cost again; default :data:`REMEASURE_AFTER`.
    :return: :attr:`AsyncMode.ASYNC` when nothing is measured yet, or the median of the last
        three background costs is at most that of the last three synchronous ones, or it is time
        to measure again; else :attr:`AsyncMode.DISABLED`.
    """
    if not async_costs or not sync_costs or syncs_in_a_row >= remeasure_after:
        return AsyncMode.ASYNC
    if _median(async_costs[-3:]) <= _median(sync_costs[-3:]):
        return AsyncMode.ASYNC
    return AsyncMode.DISABLED


@dataclasses.dataclass
class SaveCostMeter:
    """What each interval save cost the training loop, in seconds, from the time between two
    :meth:`CheckpointManager.save` calls (one training step, when it is called every step).

    The steps that began with a background save in flight count their time above the median of
    the last :attr:`window` steps that began with none (when there is none yet, above the
    fastest step of the save), summed with its sign and counted when positive. The cost of a
    background save is its blocking copy, plus any wait for it, plus that excess; it is recorded
    at the first :meth:`CheckpointManager.save` call that finds the save finished.

    :param window: free steps the median is taken over; default 20.
    """

    window: int = 20
    free_steps: list[float] = dataclasses.field(default_factory=list)
    async_costs: list[float] = dataclasses.field(default_factory=list)
    sync_costs: list[float] = dataclasses.field(default_factory=list)
    syncs_in_a_row: int = 0
    background_saves: int = 0
    _open: list[float] | None = None
    _open_fixed: float = 0.0

    def step(self, seconds: float, began_in_flight: bool) -> None:
        """Record one step (the time between two save calls, without their own blocking time).

        :param seconds: the step's wall time.
        :param began_in_flight: whether a background save was running when the step began.
        """
        if began_in_flight and self._open is not None:
            self._open.append(seconds)
        else:
            self.free_steps = (self.free_steps + [seconds])[-self.window:]

    def started_async(self, blocking: float) -> None:
        """A background save began, blocking the loop ``blocking`` seconds (its host copy)."""
        self.close_async()
        self._open, self._open_fixed = [], blocking
        self.syncs_in_a_row = 0
        self.background_saves += 1

    def waited(self, seconds: float) -> None:
        """The loop waited ``seconds`` for the background save in flight."""
        if self._open is not None:
            self._open_fixed += seconds

    def close_async(self, sync_estimate: float | None = None) -> float | None:
        """The background save in flight has finished: record and return its cost.

        :param sync_estimate: how long the same save would have taken on the training thread,
            seconds (see :func:`choose_save_mode`); recorded among the synchronous costs.
        :return: the cost, or ``None`` when no background save was open.
        """
        if self._open is None:
            return None
        steps, self._open = self._open, None
        base = _median(self.free_steps) if self.free_steps else min(steps, default=0.0)
        # signed: a step's noise above the median cancels its noise below it
        cost = self._open_fixed + max(0.0, sum(seconds - base for seconds in steps))
        self.async_costs.append(cost)
        if sync_estimate is not None:
            self.sync_costs.append(sync_estimate)
        return cost

    def saved_sync(self, seconds: float, *, interval: bool) -> None:
        """A save on the training thread took ``seconds``; ``interval``: not a forced save."""
        self.sync_costs.append(seconds)
        if interval:
            self.syncs_in_a_row += 1

    def next_mode(self) -> AsyncMode:
        """:return: :func:`choose_save_mode` of what is measured so far."""
        return choose_save_mode(self.async_costs, self.sync_costs, self.syncs_in_a_row)

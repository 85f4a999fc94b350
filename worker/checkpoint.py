"""Checkpoints of the complete training state, committed so that a torn one is never used.

Commit protocol (no atomic rename assumed, since GCS FUSE renames by copy and delete):

1. Remove any stale commit record for the step (left by an earlier attempt).
2. Write the data to ``ckpt-{step:08d}.pt``, flush and fsync.
3. Write the commit record ``ckpt-{step:08d}.commit.json`` = ``{step, size, sha256, chunk_bytes,
   chunks, created_at}`` last, through a temporary name, fsync and rename. ``chunks`` is the
   data's hash list (the sha256 of every ``chunk_bytes`` bytes) and ``sha256`` the sha256 of the
   concatenated binary chunk digests, so that the chunks hash in parallel when writing and
   verifying (:mod:`worker.fastio`). A record without ``chunks`` (older versions, hand-made)
   carries the sha256 of the whole file instead, and is verified that way.

A checkpoint exists only when its commit record parses and matches the data's size and sha256.
Anything else (a data file with no record, a truncated or corrupted file, a torn record) is
ignored by discovery and skipped, with a warning, on load.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import math
import re
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Protocol

from worker.fastio import (
    DIGEST_CHUNK, HashingWriter, SnapshotBuffers, chunk_digests, file_chunk_digests, hash_file,
    hash_stream, root_digest, save_without_crc32, stream_chunk_digests,
)
from worker.logs import StructuredLogger, utc_now
from worker.storage import LocalStorage, Storage

MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
TRAIN_STATE = "train_state"
STATE_KEYS = (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE)

DATA = "data"
COMMIT = "commit"
_SUFFIX = {DATA: ".pt", COMMIT: ".commit.json"}
#: Smallest ``chunk_bytes`` a commit record may carry, in bytes (one 4 KiB page): bounds the
#: work and memory a record asks of the verifier.
MIN_CHUNK_BYTES = 4096
#: Largest commit record read, in bytes (8 MiB: the hash list of about 7 TiB of data in 64 MiB
#: chunks). A larger one is invalid, like a torn one, and is never read whole.
MAX_RECORD_BYTES = 8 << 20
_NAME_RE = re.compile(r"^ckpt-(?P<step>\d{8,})(?P<suffix>\.pt|\.commit\.json)(?P<tmp>\.tmp)?$")


class Stateful(Protocol):
    """An object whose state is saved in checkpoints."""

    def state_dict(self) -> dict[str, Any]:
        """:return: the state, as tensors, primitives, lists and dicts only."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state returned by :meth:`state_dict`."""


@dataclasses.dataclass(frozen=True)
class ParsedName:
    """A parsed checkpoint file name.

    :param step: the optimizer step of the checkpoint.
    :param kind: :data:`DATA` or :data:`COMMIT`.
    :param temporary: whether the name carries the ``.tmp`` suffix of an unfinished write.
    """

    step: int
    kind: str
    temporary: bool = False


class CheckpointName:
    """Builds and parses checkpoint file names with one anchored regex."""

    @staticmethod
    def build(step: int, kind: str = DATA) -> str:
        """:return: ``ckpt-{step:08d}.pt`` for data, ``ckpt-{step:08d}.commit.json`` for a record.

        :param step: a non-negative step.
        :param kind: :data:`DATA` or :data:`COMMIT`.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if kind not in _SUFFIX:
            raise ValueError(f"kind must be {DATA!r} or {COMMIT!r}, got {kind!r}")
        return f"ckpt-{step:08d}{_SUFFIX[kind]}"

    @staticmethod
    def parse(name: str) -> ParsedName | None:
        """:return: the parsed name, or ``None`` when ``name`` is not a checkpoint file name."""
        match = _NAME_RE.match(name)
        if match is None:
            return None
        kind = DATA if match.group("suffix") == ".pt" else COMMIT
        return ParsedName(int(match.group("step")), kind, match.group("tmp") is not None)


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """The record that commits one checkpoint.

    :param step: the step of the checkpoint.
    :param size: size of the data file, in bytes.
    :param sha256: hex sha256 of the concatenated binary ``chunks`` digests; without ``chunks``,
        hex sha256 of the whole data file.
    :param created_at: RFC 3339 UTC time of the commit.
    :param chunk_bytes: bytes per entry of ``chunks`` (the last chunk may be shorter); 0: no
        hash list.
    :param chunks: hex sha256 of every ``chunk_bytes`` bytes of the data file, in order.
    """

    step: int
    size: int
    sha256: str
    created_at: str
    chunk_bytes: int = 0
    chunks: tuple[str, ...] = ()

    @classmethod
    def of_chunks(cls, step: int, size: int, chunks: list[str], created_at: str,
                  chunk_bytes: int = DIGEST_CHUNK) -> CommitRecord:
        """:return: the record of a data file of ``size`` bytes with hash list ``chunks``."""
        return cls(step, size, root_digest(chunks), created_at, chunk_bytes, tuple(chunks))

    def to_bytes(self) -> bytes:
        """:return: the record as JSON bytes (no hash-list keys when it has none)."""
        obj = dataclasses.asdict(self)
        if not self.chunk_bytes:
            del obj["chunk_bytes"], obj["chunks"]
        else:
            obj["chunks"] = list(self.chunks)
        return json.dumps(obj, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> CommitRecord:
        """Parse and validate a record; raises ``ValueError`` when it is torn or malformed."""
        try:
            obj = json.loads(raw.decode())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"commit record is not valid JSON: {exc!r}"[:200]) from None
        if not isinstance(obj, dict):
            raise ValueError("commit record is not a JSON object")
        step, size, digest = obj.get("step"), obj.get("size"), obj.get("sha256")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, size)):
            raise ValueError("commit record has no valid step or size")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ValueError("commit record has no valid sha256")
        if "chunks" not in obj and "chunk_bytes" not in obj:
            return cls(step, size, digest, str(obj.get("created_at", "")))
        chunk_bytes, chunks = obj.get("chunk_bytes"), obj.get("chunks")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(f"commit record has no valid chunk_bytes (an int >= {MIN_CHUNK_BYTES})")
        if not isinstance(chunks, list) or len(chunks) != -(-size // chunk_bytes):
            raise ValueError(f"commit record's hash list does not cover {size} bytes")
        if not all(isinstance(c, str) and re.fullmatch(r"[0-9a-f]{64}", c) for c in chunks):
            raise ValueError("commit record's hash list has an invalid digest")
        if root_digest(chunks) != digest:
            raise ValueError("commit record's sha256 does not match its hash list")
        return cls(step, size, digest, str(obj.get("created_at", "")), chunk_bytes, tuple(chunks))


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


@dataclasses.dataclass
class CheckpointConfig:
    """Configuration of a :class:`CheckpointManager`.

    :param folder: the task's checkpoint namespace (a plain path string).
    :param interval: save every this many optimizer steps; default 50; 0: no step interval.
    :param keep_latest_k: keep this many valid checkpoints; default 2. 1 is refused: the newest
        may be incomplete when the process is killed, and the previous one must still exist.
    :param async_mode: :attr:`AsyncMode.ASYNC` (default) or :attr:`AsyncMode.DISABLED`.
    :param load_step: step to load, or -1 for the newest valid one.
    :param interval_seconds: also save when this many seconds passed since the last save;
        default 0 (off).
    :param auto_interval: save at the Young/Daly optimum from the measured save cost and
        ``mtbi_seconds``; default off.
    :param mtbi_seconds: mean time between interruptions for ``auto_interval``, in seconds;
        default 3600.
    :param pause_before_commit_s: testing only: sleep this long (seconds) between the data
        write and the commit record, so tests can kill the process there; default 0.
    :param pause_mid_write_s: testing only: write half the data, sleep this long (seconds),
        then write all of it, so tests can leave a torn data file; default 0.

    With ``interval`` 0, ``interval_seconds`` 0 and no ``auto_interval``, checkpointing is off
    (:attr:`enabled` is false): only forced saves write.
    """

    folder: str
    interval: int = 50
    keep_latest_k: int = 2
    async_mode: AsyncMode = AsyncMode.ASYNC
    load_step: int = -1
    interval_seconds: float = 0.0
    auto_interval: bool = False
    mtbi_seconds: float = 3600.0
    pause_before_commit_s: float = 0.0
    pause_mid_write_s: float = 0.0

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
        if self.pause_before_commit_s < 0 or self.pause_mid_write_s < 0:
            raise ValueError("test pauses must be >= 0 seconds")

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


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed (raised for a background save by the next wait or save)."""


def _serialize(state: dict[str, Any]) -> bytes:
    import torch  # imported lazily: FATAL and completion checks run without torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


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


class CheckpointManager:
    """Saves, discovers, verifies, loads and purges the checkpoints of one task.

    Interval saves are asynchronous unless ``config.async_mode`` is :attr:`AsyncMode.DISABLED`:
    the caller blocks only while the state is copied into reused host buffers (pinned when the
    state is on CUDA); serialization, hashing, the write and the commit run on one background
    thread. Forced saves (final, preemption) are synchronous. Use it as a context manager;
    :meth:`close` waits for the save in flight.

    :param config: the checkpoint configuration.
    :param states: the objects to checkpoint, keyed by item name (see :data:`STATE_KEYS`).
    :param storage: the storage backend; default :class:`~worker.storage.LocalStorage`.
    :param logger: structured logger; default one on stdout.
    :param clock: monotonic clock in seconds, for save timings and time-based intervals.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        states: Mapping[str, Stateful],
        *,
        storage: Storage | None = None,
        logger: StructuredLogger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._states = dict(states)
        self._storage = storage or LocalStorage()
        self._log = logger or StructuredLogger()
        self._clock = clock
        self._save_policy = config.save_policy()
        self._keep_policy = KeepLatestN(config.keep_latest_k)
        self._snapshots = SnapshotBuffers()
        self.stats = SaveStats()
        self._verified: dict[int, str] = {}  # step -> sha256 verified (or written) by this process
        self._last_save_at = clock()
        self._logged_interval: float | None = None
        self.last_saved_step: int | None = None
        self.loaded_step: int | None = None
        self.checkpoints_written = 0
        self.failed_saves = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self.cleanup_stale()
        self._log_auto_interval()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not hide the exception in flight behind a save error
            self.close()
        except RuntimeError as exc:
            self._log.error("background checkpoint save failed during shutdown", error=str(exc))

    def path(self, step: int, kind: str = DATA) -> str:
        """:return: the path of the data file or commit record of ``step``."""
        return f"{self.config.folder.rstrip('/')}/{CheckpointName.build(step, kind)}"

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
        return YoungDalyPolicy(self.config.mtbi_seconds, floor).interval(self.stats.cost())

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

    def present_steps(self) -> list[int]:
        """:return: every step with a data file or commit record, newest first."""
        steps = set()
        for name in self._storage.list(self.config.folder):
            parsed = CheckpointName.parse(name)
            if parsed is not None and not parsed.temporary:
                steps.add(parsed.step)
        return sorted(steps, reverse=True)

    def _read_record_bytes(self, step: int) -> bytes:
        """:return: the commit record's bytes; ``ValueError`` past :data:`MAX_RECORD_BYTES`."""
        parts, left = [], MAX_RECORD_BYTES + 1
        with self._storage.open_read(self.path(step, COMMIT)) as handle:
            while left > 0:
                part = handle.read(min(left, 1 << 20))
                if not part:
                    break
                parts.append(part)
                left -= len(part)
        if left <= 0:
            raise ValueError(f"commit record is larger than {MAX_RECORD_BYTES} bytes")
        return b"".join(parts)

    def _record(self, step: int) -> tuple[CommitRecord | None, str]:
        try:
            record = CommitRecord.from_bytes(self._read_record_bytes(step))
        except FileNotFoundError:
            return None, "no commit record (uncommitted)"
        except (OSError, ValueError) as exc:
            return None, f"unreadable commit record: {exc}"
        if record.step != step:
            return None, f"commit record is for step {record.step}"
        return record, ""

    def is_valid(self, step: int) -> bool:
        """:return: whether ``step`` is committed and verified; data already verified (or
        written) by this process is not read again when its commit record is unchanged."""
        record, _ = self._record(step)
        if record is not None and self._verified.get(step) == record.sha256:
            return True
        return self.verify(step)[0]

    def verify(self, step: int) -> tuple[bool, str]:
        """Check one checkpoint against its commit record, reading (and hashing) all its data.

        :return: ``(True, "")`` when valid, else ``(False, reason)``.
        """
        record, reason = self._record(step)
        if record is None:
            return False, reason
        try:
            size = self._storage.size(self.path(step, DATA))  # a wrong size needs no hashing
            if size != record.size:
                return False, f"size {size} bytes, commit record says {record.size}"
            size, digest = self._hash_data(step, record.chunk_bytes)
        except (OSError, ValueError) as exc:
            return False, f"unreadable data file: {exc}"
        if size != record.size:
            return False, f"size {size} bytes, commit record says {record.size}"
        if record.chunk_bytes:
            bad = next((i for i, (a, b) in enumerate(zip(digest, record.chunks)) if a != b), None)
            if bad is not None:
                start = bad * record.chunk_bytes
                return False, f"sha256 of bytes {start}-{min(start + record.chunk_bytes, size) - 1} does not match the commit record"
        elif digest != record.sha256:
            return False, "sha256 does not match the commit record"
        self._verified[step] = record.sha256
        return True, ""

    def _hash_data(self, step: int, chunk_bytes: int) -> tuple[int, Any]:
        """:return: ``(size, hash list)`` of the data file for ``chunk_bytes`` > 0, else
        ``(size, sha256)``: memory-mapped when local, else streamed."""
        path = self.path(step, DATA)
        local = isinstance(self._storage, LocalStorage)
        if chunk_bytes:
            if local:
                return file_chunk_digests(path, chunk_bytes)
            with self._storage.open_read(path) as handle:
                return stream_chunk_digests(handle, chunk_bytes)
        if local:
            return hash_file(path)
        with self._storage.open_read(path) as handle:
            return hash_stream(handle)

    def valid_steps(self) -> list[int]:
        """:return: the steps of committed, verified checkpoints, newest first."""
        return [s for s in self.present_steps() if self.is_valid(s)]

    def latest_step(self) -> int | None:
        """:return: the newest valid step, or ``None`` when there is none."""
        return next((step for step in self.present_steps() if self.is_valid(step)), None)

    def cleanup_stale(self) -> None:
        """Remove leftovers of a killed attempt: temp files and uncommitted data files."""
        names = set(self._storage.list(self.config.folder))
        for name in sorted(names):
            parsed = CheckpointName.parse(name)
            if parsed is None:
                continue
            commit_name = CheckpointName.build(parsed.step, COMMIT)
            if parsed.temporary or (parsed.kind == DATA and commit_name not in names):
                if self._storage.remove_entry(self.config.folder, name):
                    self._log.info("removed stale checkpoint file", file=name, step=parsed.step)
                else:
                    self._log.warning("not removing a stale checkpoint file: a symlink, or in a "
                                      "symlinked folder", file=name, step=parsed.step)

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
            then not started), or when a synchronous save fails.
        """
        if step == self.last_saved_step or not (force or self.due(step)):
            return False
        self.wait_until_finished()
        if step == self.last_saved_step:
            return False
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
            self.failed_saves += 1
            raise CheckpointSaveError(f"checkpoint save of step {step} failed: {exc!r}") from exc
        self.stats.blocking.append(self._clock() - started)
        self._log_auto_interval()
        return True

    def _state_dicts(self) -> dict[str, Any]:
        return {key: obj.state_dict() for key, obj in self._states.items()}

    def _save_in_background(self, step: int, snapshot: dict[str, Any], started: float) -> None:
        try:
            self._commit(step, snapshot, started)
        except BaseException as exc:  # noqa: BLE001 - logged now, re-raised by wait_until_finished
            self.failed_saves += 1
            self._error = exc
            self._log.error("background checkpoint save failed", step=step, error=repr(exc),
                            file=self.path(step))

    def _commit(self, step: int, state: dict[str, Any], started: float) -> None:
        data_path, commit_path = self.path(step, DATA), self.path(step, COMMIT)
        self._storage.remove(commit_path)
        self._verified.pop(step, None)
        size, chunks = self._write_data(data_path, state)
        self._log.debug("checkpoint data written", step=step, file=data_path)
        if self.config.pause_before_commit_s:
            time.sleep(self.config.pause_before_commit_s)
        record = CommitRecord.of_chunks(step, size, chunks, utc_now())
        self._storage.write(commit_path, record.to_bytes(), atomic=True)
        self._verified[step] = record.sha256
        seconds = self._clock() - started
        self.stats.durations.append(seconds)
        self.stats.sizes.append(size)
        self.last_saved_step = step
        self.checkpoints_written += 1
        mode = "async" if threading.current_thread() is self._thread else "sync"
        self._log.info("checkpoint saved", step=step, bytes=size, seconds=round(seconds, 4),
                       file=data_path, mode=mode)
        self._purge()
        self._log_auto_interval()

    def _write_data(self, path: str, state: dict[str, Any]) -> tuple[int, list[str]]:
        """Serialize ``state`` straight into ``path``.

        :return: ``(size, hash list)``, the list per :data:`~worker.fastio.DIGEST_CHUNK` bytes.
        """
        if self.config.pause_mid_write_s:
            payload = _serialize(state)
            self._storage.write(path, payload[: len(payload) // 2])
            self._log.debug("checkpoint data half written", file=path)
            time.sleep(self.config.pause_mid_write_s)
            self._storage.write(path, payload)
            return len(payload), chunk_digests(payload)
        result: dict[str, Any] = {}

        def produce(handle: Any) -> None:
            writer = HashingWriter(handle)
            save_without_crc32(state, writer)
            result["chunks"], result["size"] = writer.digests(), writer.size

        self._storage.write(path, produce)
        return result["size"], result["chunks"]

    def _purge(self) -> None:
        doomed = self._keep_policy.to_delete(self.present_steps(), self.valid_steps())
        for step in doomed:
            for kind in (COMMIT, DATA):
                try:
                    if not self._storage.remove_entry(self.config.folder, CheckpointName.build(step, kind)):
                        self._log.warning("not deleting an old checkpoint file: a symlink, or in a "
                                          "symlinked folder", step=step, file=self.path(step, kind))
                except OSError as exc:
                    self._log.warning("could not delete old checkpoint", step=step, error=str(exc))

    def load(self, step: int | None = None) -> bool:
        """Load the newest valid checkpoint (or ``step``) into the states.

        An invalid candidate (torn, truncated, corrupt, unloadable) is skipped with a WARNING
        naming its file, and the previous one is tried.

        :param step: the step to load; default ``config.load_step`` (-1: newest valid).
        :return: whether a checkpoint was loaded (its step is then in :attr:`loaded_step`).
        """
        wanted = self.config.load_step if step is None else step
        candidates = self.present_steps() if wanted == -1 else [wanted]
        for candidate in candidates:
            state = self._read_state(candidate)
            if state is None:
                continue
            for key, obj in self._states.items():
                obj.load_state_dict(state[key])
            self.loaded_step = self.last_saved_step = candidate
            return True
        return False

    def _deserialize(self, step: int) -> Any:
        """Load a verified data file with the ``weights_only`` unpickler (no code runs).

        Local files are memory-mapped privately (copy-on-write: training never writes back into
        the checkpoint; no copy beyond the one into the states). Other storage, a mapping that
        fails, or a process whose torch mmap default is not ``MAP_PRIVATE`` read into memory.
        """
        import mmap

        import torch

        path = self.path(step, DATA)
        flags = getattr(torch.serialization, "get_default_mmap_options", lambda: mmap.MAP_PRIVATE)()
        if isinstance(self._storage, LocalStorage) and flags == mmap.MAP_PRIVATE:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except (OSError, RuntimeError) as exc:
                self._log.debug("memory-mapped load failed; reading into memory", error=str(exc))
        return torch.load(io.BytesIO(self._storage.read(path)), map_location="cpu", weights_only=True)

    def _read_state(self, step: int) -> dict[str, Any] | None:
        ok, reason = self.verify(step)
        if ok:
            try:
                state = self._deserialize(step)
                missing = [key for key in self._states if key not in state]
                if not missing:
                    return state
                reason = f"checkpoint lacks items {missing}"
            except Exception as exc:  # noqa: BLE001 - any unpickling failure means "skip it"
                reason = f"torch.load failed: {exc}"
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
        :raises CheckpointSaveError: when the background save failed (raised once).
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointSaveError(f"background checkpoint save failed: {error!r}") from error
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

"""End-to-end cost of checkpointing, digests, and checkpoint I/O against raw I/O of the same bytes.

``python benchmarks/bench_save_cost.py [--size-mib 256] [--steps 36] [--every 6] [--dir DIR]``
prints three tables and writes ``benchmarks/results/save_cost.json``:

1. digests: throughput (GB/s) of every chunk digest a commit record may name (sha256 on one
   thread and as the hash list on the helper threads, zlib CRC-32, CRC-32C when
   ``google-crc32c`` is importable) over the same buffer;
2. end-to-end: a training loop (matrix products, ``--steps`` steps) holding a state of
   ``--size-mib`` MiB, checkpointed by :class:`CheckpointManager` every ``--every`` steps with no
   saves, synchronous saves and asynchronous saves, with the new chunk digest and with sha256 (the
   old writer), and ``raw`` / ``raw-wb``: a raw write of the state's bytes at each save step
   instead of a checkpoint, plain or starting each chunk's writeback as it goes (as the
   checkpoint writer does); each run in its own process (its peak RSS from ``getrusage``). The
   overhead (wall - none) is set against ``saves x bytes / raw write bandwidth`` (target: at
   most 1.2x), the raw bandwidth measured twice: by a probe between runs (a sequential write +
   fsync of the same bytes in the same folder, with early writeback) and in place (the raw
   runs' own writes, which meet the memory and the cores as a checkpoint write in the same run
   does; the faster raw mode counts);
3. I/O in ``--dir`` (a Cloud Storage FUSE mount, or any folder): a checkpoint write and a restore
   against a raw sequential write and read of the same bytes there (target: at least 80 %), the
   bytes a restore reads (target: one checkpoint's size), and the time from a process start to
   its first training step after a restore against a process start plus one raw read (target:
   at most 1.5x).

Everything runs in ``--dir``; with ``--fuse`` in a strict-mode Cloud Storage FUSE volume of the
emulator mounted under it (the raw probes and the end-to-end runs too). ``--skip-e2e`` and
``--skip-io`` leave out part 2 or part 3.

It is a benchmark, not a test: numbers depend on the machine and its load (printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "worker"))
sys.path.insert(0, str(REPO / "benchmarks"))

MIB = 1 << 20
CHUNK = 8 << 20


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _state(size_bytes: int, seed: int = 0) -> dict[str, Any]:
    """:return: ``model`` and ``optimizer`` stateful bags of float32 tensors, ``size_bytes`` in all."""
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_checkpoint import make_state

    torch.manual_seed(seed)
    return make_state(size_bytes, seed)


def _torch_state(size_bytes: int, seed: int | None = 0) -> dict[str, Any]:
    """:return: ``model`` (an ``nn.Module`` of 64 MiB float32 parameters, a third of
    ``size_bytes``) and ``optimizer`` (``torch.optim.Adam`` over it). With a ``seed`` the
    parameters are random and the optimizer has taken one step (its two moments hold the other
    two thirds); without, the model is built zero-filled (its pages touched, as a constructor
    does) with a fresh optimizer: what a restarted process has before its restore."""
    import torch

    per = (64 << 20) // 4
    count = max(1, round(size_bytes / 3 / (per * 4)))
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(per)) for _ in range(count)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(per, generator=generator))
        _optimizer_step(model, optimizer)
    return {"model": model, "optimizer": optimizer}


def _optimizer_step(model: Any, optimizer: Any) -> None:
    """One optimizer step with a constant gradient: it reads and writes every byte of the state."""
    import torch

    for param in model.parameters():
        param.grad = torch.full_like(param, 1e-3)
    optimizer.step()


def _compute(steps: int, hidden: int) -> Any:
    """:return: a function doing one 'training step' (a fixed amount of matrix products)."""
    import torch

    a = torch.randn(hidden, hidden)
    b = torch.randn(hidden, hidden)

    def step() -> None:
        c = a
        for _ in range(4):
            c = torch.tanh(c @ b)

    return step


def child_train(args: argparse.Namespace) -> dict[str, Any]:
    """One end-to-end run in this process: build the state, train, save on the interval.

    ``--mode raw`` saves nothing: at each save step it writes the state's bytes as one raw
    sequential write + fsync of a new file (:func:`raw_write`), keeping the newest two files as
    the checkpoint runs keep two checkpoints. Its writes meet what a checkpoint write meets in
    the same run (the memory that retention freed, the training beside it), and their own
    seconds give the raw write bandwidth in place (``raw_write_seconds``). ``--mode raw-wb`` is
    the same with each chunk's writeback started as it is written, as the checkpoint writer
    does."""
    import torch

    from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager
    from gpu_resilience_worker.logs import StructuredLogger

    if args.threads:
        torch.set_num_threads(args.threads)
    states = _state(args.size_mib * MIB)
    step = _compute(args.steps, args.hidden)
    folder = Path(args.dir) / f"run-{args.mode}-{args.digest}-{os.getpid()}"
    logger = StructuredLogger(open(os.devnull, "w"))
    extra: dict[str, Any] = {}
    started = time.perf_counter()
    if args.mode in ("none", "raw", "raw-wb"):
        from bench_checkpoint import state_bytes  # importable: _state put benchmarks/ on the path

        size = state_bytes(states)
        kept: list[Path] = []
        seconds: list[float] = []
        if args.mode != "none":
            folder.mkdir()
        for number in range(1, args.steps + 1):
            step()
            for bag in states.values():  # the optimizer touches its state every step
                next(iter(bag.tensors.values())).add_(1e-6)
            if args.mode != "none" and number % args.every == 0:
                kept.append(folder / f"raw-{number:08d}.bin")
                seconds.append(raw_write(kept[-1], size, writeback=args.mode == "raw-wb"))
                while len(kept) > 2:
                    kept.pop(0).unlink()
        saves, written = len(seconds), size * len(seconds)
        if seconds:
            extra["raw_write_seconds"] = seconds
    else:
        mode = {"sync": AsyncMode.DISABLED, "async": AsyncMode.ASYNC}[args.mode]
        config = CheckpointConfig(folder=str(folder), interval=args.every, keep_latest_k=2, async_mode=mode)
        with CheckpointManager(config, states, logger=logger) as manager:
            if args.digest != "default":
                manager._store.digest = args.digest
            for number in range(1, args.steps + 1):
                step()
                for bag in states.values():
                    next(iter(bag.tensors.values())).add_(1e-6)
                manager.save(number)
        saves, written = len(manager.stats.sizes), sum(manager.stats.sizes)
        extra["save_seconds"] = list(manager.stats.durations)
        extra["blocking_seconds"] = list(manager.stats.blocking)
    wall = time.perf_counter() - started
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    return {"wall_s": wall, "saves": saves, "bytes_written": written, "peak_rss_bytes": _rss_peak_bytes(),
            "threads": torch.get_num_threads(), **extra}


#: The end-to-end runs, by name: (save mode, chunk digest); ``default`` is the writer's own digest.
E2E_MODES: dict[str, tuple[str, str]] = {
    "none": ("none", "default"),
    "raw": ("raw", "default"),
    "raw-wb": ("raw-wb", "default"),
    "sync": ("sync", "default"),
    "async": ("async", "default"),
    "sync (sha256, old)": ("sync", "sha256"),
    "async (sha256, old)": ("async", "sha256"),
}


def raw_write(path: Path, size: int, writeback: bool = False) -> float:
    """:return: seconds of a sequential write + fsync of ``size`` bytes to the new file ``path``,
    in :data:`CHUNK` writes from one buffer.

    :param writeback: start the writeback of each chunk as it is written
        (:func:`~gpu_resilience_worker.fastio.start_writeback`, as the checkpoint writer does),
        so that the closing fsync has little left; without it the whole flush waits for the fsync.
    """
    from gpu_resilience_worker.fastio import start_writeback

    buffer = memoryview(os.urandom(CHUNK))
    started = time.perf_counter()
    with open(path, "xb", buffering=0) as handle:
        offset = 0
        while offset < size:
            take = min(size - offset, CHUNK)
            handle.write(buffer[:take])
            if writeback:
                start_writeback(handle.fileno(), offset, take)
            offset += take
        os.fsync(handle.fileno())
    return time.perf_counter() - started


def raw_read(path: Path, into_new_memory: bool = False) -> tuple[float, int]:
    """:return: (seconds, bytes) of one sequential read of ``path`` into one reused buffer, or,
    with ``into_new_memory``, into new memory of its size (an anonymous mapping, its pages first
    touched by the read): the least any loader that keeps the bytes must do."""
    import mmap

    size = path.stat().st_size
    memory = mmap.mmap(-1, max(size, 1)) if into_new_memory else bytearray(CHUNK)
    view = memoryview(memory)
    started, total = time.perf_counter(), 0
    try:
        with open(path, "rb", buffering=0) as handle:
            while True:
                with (view[total : total + CHUNK] if into_new_memory else view[:]) as target:
                    count = handle.readinto(target)
                if not count:
                    break
                total += count
        return time.perf_counter() - started, total
    finally:
        view.release()
        if into_new_memory:
            memory.close()


def _drop(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError:
        pass


def bench_digests(size: int) -> dict[str, float]:
    """:return: GB/s of each chunk digest over ``size`` random bytes (best of 3)."""
    from gpu_resilience_worker.fastio import ChunkHasher, crc32c_available, new_hasher

    data = memoryview(bytearray(os.urandom(size)))
    out: dict[str, float] = {}

    def best(action: Any) -> float:
        seconds = min(_timed(action) for _ in range(3))
        return round(size / seconds / 1e9, 3)

    def one(kind: str) -> Any:
        def run() -> None:
            hasher = new_hasher(kind)
            for offset in range(0, size, CHUNK):
                hasher.update(data[offset : offset + CHUNK])
            hasher.hexdigest()
        return run

    out["sha256 (1 thread)"] = best(one("sha256"))

    def listed() -> None:
        hasher = ChunkHasher(digest="sha256")
        for future in hasher.submit(data):
            future.result()

    out["sha256 hash list (helper threads)"] = best(listed)
    out["crc32 (zlib)"] = best(one("crc32"))
    if crc32c_available():
        out["crc32c (google-crc32c)"] = best(one("crc32c"))
    out["memcpy"] = best(lambda: bytearray(data))
    return out


def _timed(action: Any) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _child(extra: list[str], args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--size-mib", str(args.size_mib), "--steps", str(args.steps),
               "--every", str(args.every), "--hidden", str(args.hidden), "--dir", args.dir,
               "--threads", str(args.threads), *extra]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"child {extra} failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


class _Counting:
    """Wraps a file opened for reading and counts the bytes read."""

    def __init__(self, handle: BinaryIO, counter: list[int]) -> None:
        self._handle, self._counter = handle, counter

    def readinto(self, buffer: Any) -> int:
        count = self._handle.readinto(buffer) or 0
        self._counter[0] += count
        return count

    def read(self, size: int = -1) -> bytes:
        data = self._handle.read(size)
        self._counter[0] += len(data)
        return data

    def __enter__(self) -> _Counting:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()


def child_restart(args: argparse.Namespace) -> dict[str, Any]:
    """A restarted worker: import, build the model and optimizer, restore the newest checkpoint,
    one training step (matrix products and an optimizer step over the whole state). With
    ``--raw``: the same, but one raw read of the checkpoint file instead of the restore."""
    from gpu_resilience_worker.checkpoint import CheckpointConfig, CheckpointManager
    from gpu_resilience_worker.logs import StructuredLogger
    from gpu_resilience_worker.storage import LocalStorage

    counter = [0]

    class CountingStorage(LocalStorage):
        def open_read(self, path: str) -> BinaryIO:
            handle = super().open_read(path)
            return _Counting(handle, counter) if path.endswith(".pt") else handle  # type: ignore[return-value]

        def read(self, path: str) -> bytes:
            data = super().read(path)
            if path.endswith(".pt"):
                counter[0] += len(data)
            return data

    import torch  # noqa: F401 - imported here, so that the first phase holds the interpreter and torch

    phases = {"imported": time.time()}
    states = _torch_state(args.size_mib * MIB, seed=None)
    step = _compute(1, args.hidden)
    phases["built"] = time.time()
    folder = Path(args.dir) / "restore"
    if args.raw:
        data = sorted(folder.glob("ckpt-*.pt"))[-1]
        _, counter[0] = raw_read(data)
    else:
        config = CheckpointConfig(folder=str(folder), interval=0)
        with CheckpointManager(config, states, storage=CountingStorage(),
                               logger=StructuredLogger(open(os.devnull, "w"))) as manager:
            assert manager.load(), "no checkpoint restored"
    phases["restored"] = time.time()
    step()
    _optimizer_step(states["model"], states["optimizer"])
    phases["first_step"] = time.time()
    return {"first_step_at": phases["first_step"], "phases": phases, "bytes_read": counter[0],
            "peak_rss_bytes": _rss_peak_bytes()}


def _phase_seconds(started: float, phases: dict[str, float]) -> dict[str, float]:
    """:return: seconds of each phase of a restarted child: start and imports, building the model
    and optimizer, the restore (or raw read), the first step."""
    marks = [("start_and_import", phases["imported"]), ("build", phases["built"]),
             ("restore_or_read", phases["restored"]), ("first_step", phases["first_step"])]
    out, previous = {}, started
    for name, at in marks:
        out[name] = round(at - previous, 3)
        previous = at
    return out


def bench_io(args: argparse.Namespace, mount: Any = None) -> dict[str, Any]:
    """Checkpoint write/restore in ``--dir`` against raw sequential I/O of the same bytes there.

    The state is a real model and Adam optimizer (:func:`_torch_state`); a restore loads into a
    freshly built model and optimizer, as a restarted worker does. Raw read and restore alternate
    ``--repeats`` times, each from a dropped page cache; the fastest of each counts (all are kept).
    """
    from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager
    from gpu_resilience_worker.logs import StructuredLogger

    folder = Path(args.dir) / "restore"
    folder.mkdir(parents=True, exist_ok=True)
    states = _torch_state(args.size_mib * MIB)
    logger = StructuredLogger(open(os.devnull, "w"))
    config = CheckpointConfig(folder=str(folder), interval=1, keep_latest_k=2, async_mode=AsyncMode.DISABLED)
    with CheckpointManager(config, states, logger=logger) as manager:
        write_s = _timed(lambda: manager.save(1, force=True))
        size = manager.stats.sizes[-1]
    del states
    raw_file = Path(args.dir) / "raw.bin"
    raw_file.unlink(missing_ok=True)
    raw_write_s = raw_write(raw_file, size, writeback=True)  # as the checkpoint writer writes
    data_file = folder / "ckpt-00000001.pt"
    data_object = os.path.relpath(data_file, mount.mountpoint) if mount is not None else None
    raw_reads, memory_reads, restores, fuse_reads = [], [], [], []
    for _ in range(args.repeats):
        _drop(raw_file)
        raw_reads.append(raw_read(raw_file)[0])
        _drop(raw_file)
        memory_reads.append(raw_read(raw_file, into_new_memory=True)[0])
        fresh = _torch_state(args.size_mib * MIB, seed=None)
        _drop(data_file)
        before = mount.stats()["bytesRead"].get(data_object, 0) if mount is not None else 0
        with CheckpointManager(CheckpointConfig(folder=str(folder), interval=0), fresh, logger=logger) as manager:
            restores.append(_timed(manager.load))
        if mount is not None:
            fuse_reads.append(mount.stats()["bytesRead"].get(data_object, 0) - before)
        del fresh
    raw_file.unlink()
    restarts, raw_starts, phases = [], [], {"restore": [], "raw": []}
    for _ in range(args.repeats):
        _drop(data_file)
        started = time.time()
        restored = _child(["--child", "restart"], args)
        restarts.append(restored["first_step_at"] - started)
        phases["restore"].append(_phase_seconds(started, restored["phases"]))
        _drop(data_file)
        started = time.time()
        raw = _child(["--child", "restart", "--raw"], args)
        raw_starts.append(raw["first_step_at"] - started)
        phases["raw"].append(_phase_seconds(started, raw["phases"]))
    restore_s, raw_read_s = min(restores), min(raw_reads)
    restart_s, raw_start_s = min(restarts), min(raw_starts)
    return {
        "bytes": size, "checkpoint_write_s": write_s, "raw_write_s": raw_write_s,
        "write_ratio": raw_write_s / write_s, "restore_s": restore_s, "raw_read_s": raw_read_s,
        "restore_all_s": restores, "raw_read_all_s": raw_reads,
        "raw_read_to_memory_s": min(memory_reads), "raw_read_to_memory_all_s": memory_reads,
        "restore_ratio_to_memory_read": min(memory_reads) / restore_s,
        "restore_ratio": raw_read_s / restore_s, "bytes_read_per_restore": restored["bytes_read"],
        "restart_to_first_step_s": restart_s, "start_plus_raw_read_s": raw_start_s,
        "restart_all_s": restarts, "start_plus_raw_read_all_s": raw_starts, "restart_phases_s": phases,
        "restart_ratio": restart_s / raw_start_s, "restart_peak_rss_bytes": restored["peak_rss_bytes"],
        "raw_start_peak_rss_bytes": raw["peak_rss_bytes"],
        "fuse_bytes_read_per_restore": max(fuse_reads) if fuse_reads else None,
        "fuse_events": mount.stats() if mount is not None else None,
    }


def _ratios(overhead: float, written: int, probe: float, in_place: float | None,
            in_run: float | None = None) -> str:
    """:return: ``overhead / (written / bandwidth)`` against the probe and, when measured, in place
    and by the raw run's cost (``"1.20 / 0.95 / 1.05"``), or ``"-"`` for a run that wrote nothing."""
    if not written:
        return "-"
    bandwidths = [probe, in_place, in_run] if in_run else [probe, in_place] if in_place else [probe]
    return " / ".join(f"{overhead / (written / bandwidth):.2f}" if bandwidth else "-" for bandwidth in bandwidths)


def render(result: dict[str, Any]) -> str:
    import common

    lines = common.machine_lines(result["machine"])
    lines.append(f"state {result['size_mib']} MiB, {result['steps']} steps, a save every {result['every']} steps; "
                 f"folder {result['dir']} ({result['dir_kind']}); nice {result['nice']}")
    lines.append("")
    lines.append("chunk digests (GB/s, best of 3)")
    for name, rate in result["digests"].items():
        lines.append(f"  {name:36s} {rate:8.3f}")
    bandwidth = result["raw_write_bytes_per_s"]
    if result["runs"]:  # none with --skip-e2e
        lines.append("")
        lines.extend(_e2e_lines(result, bandwidth))
    lines.extend(_grid_lines(result))
    lines.extend(_io_lines(result.get("io")))
    return "\n".join(lines)


def _e2e_lines(result: dict[str, Any], bandwidth: float) -> list[str]:
    lines = [f"end to end (raw write bandwidth {bandwidth / 1e6:.0f} MB/s)"]
    lines.append(f"  (wall: the fastest of {result['repeats']} interleaved runs, the one least slowed by other load;"
                 " median: of all of them)")
    in_place, in_run = in_place_bandwidth(result["runs"]), raw_run_bandwidth(result["runs"])
    if in_place:
        lines.append(f"  (in place, by the raw runs' own writes: {in_place / 1e6:.0f} MB/s"
                     + (f"; by the raw run's cost: {in_run / 1e6:.0f} MB/s" if in_run else "")
                     + "; ratio: against the probe / in place" + (" / the raw run's cost)" if in_run else ")"))
    lines.append(f"  {'mode':22s} {'wall s':>8s} {'median s':>8s} {'overhead s':>10s} {'bytes/raw bw s':>14s} {'ratio':>18s}"
                 f" {'peak RSS GB':>11s}")
    for name, run in result["runs"].items():
        ideal = run["bytes_written"] / bandwidth
        overhead = run["wall_s"] - result["runs"]["none"]["wall_s"]
        ratio = _ratios(overhead, run["bytes_written"], bandwidth, in_place, in_run)
        median = statistics.median(run.get("wall_all_s") or [run["wall_s"]])
        lines.append(f"  {name:22s} {run['wall_s']:8.2f} {median:8.2f} {overhead:10.2f} {ideal:14.2f} {ratio:>18s} "
                     f"{run['peak_rss_bytes'] / 1e9:11.2f}")
    return lines


def _grid_lines(result: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if result.get("grid"):
        lines.append("")
        lines.append("sweep: wall s, the fastest / the median of the interleaved runs; ratio = (fastest - none) /"
                     " (bytes / raw write bandwidth), target <= 1.2, against the probe (one write between runs,"
                     " the median of one a round), in place (the raw runs' own writes, the median run) and by the raw run's"
                     " cost (the fastest raw run's bytes over its wall time beyond none: a checkpoint's cost against"
                     " a raw writer's in the same loop)")
        modes = [name for name in (*RAW_MODES, "sync", "async") if any(name in p["runs"] for p in result["grid"])]
        lines.append(f"  {'MiB':>5s} {'every':>5s} {'threads':>7s} {'probe MB/s':>10s} {'in place':>8s} {'none':>13s} "
                     + " ".join(f"{name:>13s}" for name in modes) + " "
                     + " ".join(f"{name + ' ratio':>20s}" for name in modes) + "  async <= sync (fastest, median)")
        for point in result["grid"]:
            runs, bandwidth = point["runs"], point["raw_write_bytes_per_s"]
            in_place, in_run = in_place_bandwidth(runs), raw_run_bandwidth(runs)
            none = runs["none"]["wall_s"]

            def median(name: str) -> float:
                return statistics.median(runs[name].get("wall_all_s") or [runs[name]["wall_s"]])

            def walls(name: str) -> str:
                return f"{runs[name]['wall_s']:.2f} / {median(name):.2f}" if name in runs else "-"

            def ratio(name: str) -> str:
                run = runs.get(name)
                if not run:
                    return "-"
                return _ratios(run["wall_s"] - none, run["bytes_written"], bandwidth, in_place, in_run)

            def verdict(first: str, second: str) -> str:
                if first not in runs or second not in runs:
                    return "-"
                fastest = runs[first]["wall_s"] <= runs[second]["wall_s"]
                return f"{'yes' if fastest else 'NO'}, {'yes' if median(first) <= median(second) else 'NO'}"

            place = f"{in_place / 1e6:8.0f}" if in_place else f"{'-':>8s}"
            lines.append(f"  {point['size_mib']:5d} {point['every']:5d} {point['threads'] or 'dflt':>7} {bandwidth / 1e6:10.0f} "
                         f"{place} {walls('none'):>13s} " + " ".join(f"{walls(name):>13s}" for name in modes) + " "
                         + " ".join(f"{ratio(name):>20s}" for name in modes) + f"  {verdict('async', 'sync')}")
    return lines


def _io_lines(io: dict[str, Any] | None) -> list[str]:
    lines: list[str] = []
    if io:
        lines.append("")
        lines.append(f"I/O in the folder ({io['bytes'] / 1e6:.0f} MB checkpoint)")
        lines.append(f"  checkpoint write {io['checkpoint_write_s']:.2f} s vs raw write {io['raw_write_s']:.2f} s: "
                     f"{100 * io['write_ratio']:.0f} % of raw (target >= 80 %)")
        lines.append(f"  restore {io['restore_s']:.2f} s vs raw read {io['raw_read_s']:.2f} s: "
                     f"{100 * io['restore_ratio']:.0f} % of raw (target >= 80 %)"
                     + (f"; fastest of {len(io['restore_all_s'])} each, all: restore "
                        + ", ".join(f"{x:.2f}" for x in io["restore_all_s"]) + "; raw read "
                        + ", ".join(f"{x:.2f}" for x in io["raw_read_all_s"]) if io.get("restore_all_s") else ""))
        if io.get("raw_read_to_memory_s") is not None:
            lines.append(f"  restore vs a raw read into new memory of the file's size {io['raw_read_to_memory_s']:.2f} s "
                         f"(the least a loader that keeps the bytes does): {100 * io['restore_ratio_to_memory_read']:.0f} %")
        lines.append(f"  bytes read per restore {io['bytes_read_per_restore']} = "
                     f"{io['bytes_read_per_restore'] / io['bytes']:.2f} x the checkpoint (target 1)")
        if io.get("fuse_bytes_read_per_restore") is not None:
            events = io["fuse_events"]
            lines.append(f"  FUSE volume's count of bytes read per restore {io['fuse_bytes_read_per_restore']}; "
                         f"staged writes {events['staged']}, throttled rewrites {events['throttled']}, "
                         f"non-atomic renames {events['nonAtomicRenames']}")
        lines.append(f"  restart to first step {io['restart_to_first_step_s']:.2f} s vs start + raw read "
                     f"{io['start_plus_raw_read_s']:.2f} s: {io['restart_ratio']:.2f} x (target <= 1.5)")
        for kind, runs in (io.get("restart_phases_s") or {}).items():
            for phases in runs:
                lines.append(f"    {kind:7s} " + ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases.items()))
    return lines


def run_e2e(args: argparse.Namespace) -> tuple[dict[str, Any], list[float]]:
    """The end-to-end runs of ``args.modes`` at ``args.size_mib``, ``args.every`` and
    ``args.threads``: ``args.repeats`` interleaved rounds, each mode in its own process.

    :return: ``(runs, probes)``: per mode, its first run's figures with the fastest wall time
        (``wall_s``), all wall times (``wall_all_s``) and the highest peak RSS; and the raw write
        bandwidth (bytes/s) probed once a round (:func:`raw_bandwidth` with the state's size).
    """
    samples: dict[str, list[dict[str, Any]]] = {}
    probes: list[float] = []
    for repeat in range(args.repeats):
        # the raw bandwidth once a round: one probe moved by 3x between runs here (shared disk)
        probes.append(raw_bandwidth(args.dir, args.size_mib * MIB))
        # interleaved, and rotated by one each repeat, so that a change of load hits every mode
        # and no mode always runs first or last
        shift = repeat % len(args.modes)
        for name in args.modes[shift:] + args.modes[:shift]:
            mode, digest = E2E_MODES[name]
            run = _child(["--child", "train", "--mode", mode, "--digest", digest], args)
            samples.setdefault(name, []).append(run)
            print(f"{repeat}: {args.size_mib} MiB every {args.every} threads {args.threads or 'default'}: "
                  f"{name}: {run['wall_s']:.2f} s", file=sys.stderr, flush=True)
    runs: dict[str, Any] = {}
    for name, got in samples.items():
        walls = sorted(r["wall_s"] for r in got)
        runs[name] = {**got[0], "wall_s": walls[0], "wall_all_s": walls,
                      "peak_rss_bytes": max(r["peak_rss_bytes"] for r in got)}
        if name in RAW_MODES:  # each raw run's write bandwidth in place: its bytes over its writes' seconds
            runs[name]["in_place_bytes_per_s_all"] = [r["bytes_written"] / sum(r["raw_write_seconds"])
                                                      for r in got if r.get("raw_write_seconds")]
        for key in ("save_seconds", "blocking_seconds", "raw_write_seconds"):
            if key in got[0]:
                runs[name][key + "_all"] = [r[key] for r in got]
    return runs, probes


#: The end-to-end modes that write raw bytes instead of checkpoints.
RAW_MODES = ("raw", "raw-wb")


def in_place_bandwidth(runs: dict[str, Any]) -> float | None:
    """:return: the raw write bandwidth in place (bytes/s): of each raw mode that ran (``raw``,
    ``raw-wb``), the median over its runs, and of those the higher (the best a plain writer did:
    the fair baseline); ``None`` when no raw mode ran."""
    medians = [statistics.median(rates) for name in RAW_MODES
               if (rates := (runs.get(name) or {}).get("in_place_bytes_per_s_all"))]
    return max(medians) if medians else None


def raw_run_bandwidth(runs: dict[str, Any]) -> float | None:
    """:return: the raw write bandwidth by its cost to the run (bytes/s): of each raw mode that ran,
    its bytes over its wall time beyond the run with no saves (the fastest of each), and of those
    the higher. It is what writing the state's bytes raw at the same steps costs the same training
    loop, so ``overhead / (bytes / this)`` is a checkpoint's cost against a raw writer's in the same
    run (1.0: the same). ``None`` when no raw mode ran, no ``none`` run is there, or every raw run
    was no slower than ``none`` (a cost of zero or less gives no bandwidth)."""
    if "none" not in runs:
        return None
    none = runs["none"]["wall_s"]
    rates = [run["bytes_written"] / (run["wall_s"] - none) for name in RAW_MODES
             if (run := runs.get(name)) and run.get("bytes_written") and run["wall_s"] > none]
    return max(rates) if rates else None


def raw_bandwidth(folder: str, size: int) -> float:
    """:return: bytes/s of one sequential write + fsync of ``size`` new bytes in ``folder``, each
    chunk's writeback started as it is written (the faster way on a disk, as the checkpoint
    writer writes; the same bytes in memory)."""
    # a new name each probe: rewriting one object within a second is throttled on Cloud Storage
    # (and counted by the FUSE volume), which is no part of what a checkpoint costs
    raw_file = Path(folder) / f"raw-bandwidth-{time.time_ns()}.bin"
    raw_file.unlink(missing_ok=True)
    try:
        return size / raw_write(raw_file, size, writeback=True)
    finally:
        raw_file.unlink(missing_ok=True)


def run_grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The end-to-end comparison at every ``--grid`` point (``SIZE_MIB:EVERY[:THREADS]``), each
    against the median of the raw bandwidth probes of its rounds (its own state size)."""
    points = []
    for spec in args.grid:
        size, every, threads = parse_grid_point(spec)
        point = argparse.Namespace(**{**vars(args), "size_mib": size, "every": every, "threads": threads})
        runs, probes = run_e2e(point)
        points.append({"size_mib": size, "every": every, "threads": threads,
                       "raw_write_bytes_per_s": statistics.median(probes),
                       "raw_write_probes_bytes_per_s": probes, "runs": runs})
    return points


def parse_grid_point(spec: str) -> tuple[int, int, int]:
    """:return: ``(size MiB, every, threads)`` of ``SIZE_MIB:EVERY[:THREADS]`` (threads 0: torch's default).
    :raises ValueError: for anything else, or a value not > 0."""
    parts = spec.split(":")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        values = []
    if len(values) not in (2, 3) or min(values[:2]) <= 0 or (len(values) == 3 and values[2] < 0):
        raise ValueError(f"--grid points are SIZE_MIB:EVERY[:THREADS] with positive numbers, got {spec!r}")
    return values[0], values[1], values[2] if len(values) == 3 else 0


def measure(args: argparse.Namespace, mount: Any = None) -> dict[str, Any]:
    """:return: every table's figures, measured in ``args.dir`` (``mount``: the FUSE mount there)."""
    import common
    from gpu_resilience_worker.fastio import default_digest

    result: dict[str, Any] = {"machine": common.machine_info(), "size_mib": args.size_mib, "steps": args.steps,
                              "every": args.every, "repeats": args.repeats, "dir": args.dir, "dir_kind": args.dir_kind,
                              "nice": os.nice(0), "default_digest": default_digest()}
    result["digests"] = bench_digests(min(args.size_mib, 256) * MIB)
    result["raw_write_bytes_per_s"] = raw_bandwidth(args.dir, args.size_mib * MIB)
    runs: dict[str, Any] = {}
    if not args.skip_e2e:  # the median of the probes of the rounds, the first one included
        runs, probes = run_e2e(args)
        result["raw_write_probes_bytes_per_s"] = [result["raw_write_bytes_per_s"], *probes]
        result["raw_write_bytes_per_s"] = statistics.median(result["raw_write_probes_bytes_per_s"])
    result["runs"] = runs
    if args.grid:
        result["grid"] = run_grid(args)
    if not args.skip_io:
        result["io"] = bench_io(args, mount)
    elif mount is not None:  # what the end-to-end runs cost the volume
        result["fuse_events"] = mount.stats()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256,
                        help="state size in MiB (default 256); the I/O table's model and Adam state is made of "
                             "64 MiB parameters, so it is this rounded to a multiple of 192 MiB (at least 192)")
    parser.add_argument("--steps", type=int, default=36, help="training steps per run (default 36)")
    parser.add_argument("--every", type=int, default=6, help="steps between saves (default 6)")
    parser.add_argument("--hidden", type=int, default=512, help="matrix size of the compute (default 512)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, interleaved; the fastest counts (default 3)")
    parser.add_argument("--dir", default=None, help="folder of the checkpoints (default a temp dir)")
    parser.add_argument("--dir-kind", default="local folder", help="what --dir is, for the report")
    parser.add_argument("--skip-e2e", action="store_true", help="only the digests and the I/O table")
    parser.add_argument("--skip-io", action="store_true", help="no I/O table (the digests and the end-to-end runs)")
    parser.add_argument("--modes", nargs="+", default=list(E2E_MODES), choices=list(E2E_MODES), metavar="MODE",
                        help="end-to-end runs to make (default all: " + ", ".join(E2E_MODES) + "); 'none' is always run")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads of the training runs (default 0: torch's default)")
    parser.add_argument("--grid", nargs="+", default=[], metavar="SIZE_MIB:EVERY[:THREADS]",
                        help="also run the end-to-end comparison at each of these settings (a sweep)")
    parser.add_argument("--fuse", action="store_true",
                        help="run in a strict-mode Cloud Storage FUSE volume of the emulator mounted under --dir")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "save_cost.json"))
    parser.add_argument("--child", choices=("train", "restart"), help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--digest", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.size_mib <= 0 or args.steps <= 0 or args.every <= 0:
        parser.error("--size-mib, --steps and --every must be > 0")
    for spec in args.grid:
        try:
            parse_grid_point(spec)
        except ValueError as exc:
            parser.error(str(exc))
    if "none" not in args.modes:  # every overhead is measured against it
        args.modes = ["none", *args.modes]
    if args.child:
        result = child_train(args) if args.child == "train" else child_restart(args)
        print(json.dumps(result))
        return 0
    import common

    temp = None
    if args.dir is None:
        temp = tempfile.TemporaryDirectory(prefix="bench-save-cost-", dir=str(REPO / ".bench") if (REPO / ".bench").is_dir() else None)
        args.dir = temp.name
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        mount = None
        if args.fuse:  # everything below (raw probes, end-to-end runs, I/O) goes through the mount
            from cloud_run_emulator.gcsfuse import GcsFuseMount

            base = Path(args.dir)
            mount = stack.enter_context(GcsFuseMount(base / "bucket", base / "mnt", base / "state", strict=True))
            args.dir, args.dir_kind = str(mount.mountpoint), "emulator's Cloud Storage FUSE volume, strict mode"
        result = measure(args, mount)
    result["machine"]["load_at_end"] = common.load()
    if temp is not None:
        temp.cleanup()
    print(render(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

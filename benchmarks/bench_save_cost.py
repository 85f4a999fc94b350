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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "worker"))
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402
from common import CHUNK, MIB, drop_cache, raw_read, raw_write, timed  # noqa: E402
from save_cost_children import _torch_state, child_restart, child_train  # noqa: E402
from save_cost_report import RAW_MODES, _ratios, in_place_bandwidth, raw_run_bandwidth, render  # noqa: E402,F401 - the tests and the docs read them here


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


def bench_digests(size: int) -> dict[str, float]:
    """:return: GB/s of each chunk digest over ``size`` random bytes (best of 3)."""
    from gpu_resilience_worker.fastio import ChunkHasher, crc32c_available, new_hasher

    data = memoryview(bytearray(os.urandom(size)))
    out: dict[str, float] = {}

    def best(action: Any) -> float:
        seconds = min(timed(action) for _ in range(3))
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


def _child(extra: list[str], args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--size-mib", str(args.size_mib), "--steps", str(args.steps),
               "--every", str(args.every), "--hidden", str(args.hidden), "--dir", args.dir,
               "--threads", str(args.threads), *extra]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"child {extra} failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


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
    """Checkpoint write/restore in ``--dir`` against raw sequential I/O of the same bytes there,
    and a restarted worker's first step against a start plus a raw read (:func:`bench_restarts`).

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
        write_s = timed(lambda: manager.save(1, force=True))
        size = manager.stats.sizes[-1]
    del states
    raw_file = Path(args.dir) / "raw.bin"
    raw_file.unlink(missing_ok=True)
    raw_write_s = raw_write(raw_file, size, writeback=True)  # as the checkpoint writer writes
    data_file = folder / "ckpt-00000001.pt"
    data_object = os.path.relpath(data_file, mount.mountpoint) if mount is not None else None
    raw_reads, memory_reads, restores, fuse_reads = [], [], [], []
    for _ in range(args.repeats):
        drop_cache(raw_file, ignore_errors=True)
        raw_reads.append(raw_read(raw_file)[0])
        drop_cache(raw_file, ignore_errors=True)
        memory_reads.append(raw_read(raw_file, into_new_memory=True)[0])
        fresh = _torch_state(args.size_mib * MIB, seed=None)
        drop_cache(data_file, ignore_errors=True)
        before = mount.stats()["bytesRead"].get(data_object, 0) if mount is not None else 0
        with CheckpointManager(CheckpointConfig(folder=str(folder), interval=0), fresh, logger=logger) as manager:
            restores.append(timed(manager.load))
        if mount is not None:
            fuse_reads.append(mount.stats()["bytesRead"].get(data_object, 0) - before)
        del fresh
    raw_file.unlink()
    restore_s, raw_read_s = min(restores), min(raw_reads)
    return {
        "bytes": size, "checkpoint_write_s": write_s, "raw_write_s": raw_write_s,
        "write_ratio": raw_write_s / write_s, "restore_s": restore_s, "raw_read_s": raw_read_s,
        "restore_all_s": restores, "raw_read_all_s": raw_reads,
        "raw_read_to_memory_s": min(memory_reads), "raw_read_to_memory_all_s": memory_reads,
        "restore_ratio_to_memory_read": min(memory_reads) / restore_s,
        "restore_ratio": raw_read_s / restore_s, **bench_restarts(args, data_file),
        "fuse_bytes_read_per_restore": max(fuse_reads) if fuse_reads else None,
        "fuse_events": mount.stats() if mount is not None else None,
    }


def bench_restarts(args: argparse.Namespace, data_file: Path) -> dict[str, Any]:
    """A restarted worker's start to its first step after a restore (:func:`child_restart`)
    against a start plus one raw read of ``data_file``, alternating ``--repeats`` times, each
    from a dropped page cache; the fastest of each counts (all are kept, with their phases).

    :return: the I/O table's restart figures and the bytes the last restore read.
    """
    restarts, raw_starts, phases = [], [], {"restore": [], "raw": []}
    for _ in range(args.repeats):
        drop_cache(data_file, ignore_errors=True)
        started = time.time()
        restored = _child(["--child", "restart"], args)
        restarts.append(restored["first_step_at"] - started)
        phases["restore"].append(_phase_seconds(started, restored["phases"]))
        drop_cache(data_file, ignore_errors=True)
        started = time.time()
        raw = _child(["--child", "restart", "--raw"], args)
        raw_starts.append(raw["first_step_at"] - started)
        phases["raw"].append(_phase_seconds(started, raw["phases"]))
    restart_s, raw_start_s = min(restarts), min(raw_starts)
    return {
        "bytes_read_per_restore": restored["bytes_read"],
        "restart_to_first_step_s": restart_s, "start_plus_raw_read_s": raw_start_s,
        "restart_all_s": restarts, "start_plus_raw_read_all_s": raw_starts, "restart_phases_s": phases,
        "restart_ratio": restart_s / raw_start_s, "restart_peak_rss_bytes": restored["peak_rss_bytes"],
        "raw_start_peak_rss_bytes": raw["peak_rss_bytes"],
    }


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


def _parser() -> argparse.ArgumentParser:
    """:return: the command line's parser (the ``--child`` options are the runs' own, hidden)."""
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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Measure, print the tables, write the JSON (``--out``); or, with ``--child``, one measured
    process (:mod:`save_cost_children`), its figures printed as JSON. :return: 0."""
    parser = _parser()
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

"""Benchmark of the worker's checkpoint saves and loads, on CPU, everything in one run.

``python benchmarks/bench_checkpoint.py [--size-gib 1.0] [--repeats 5] [--dir DIR]`` prints a
table and writes ``benchmarks/results/checkpoint.json``. It measures, for one state of ``--size-gib``:

- blocking time per save: :class:`gpu_resilience_worker.checkpoint.CheckpointManager`'s async path, a
  synchronous ``torch.save`` + fsync, a plain in-memory copy (``clone``), and
  ``torch.distributed.checkpoint.async_save`` (the no-dist path);
- write throughput of the async save (start to commit) against a raw sequential write + fsync of
  the same number of bytes in the same directory, run right after each save;
- load throughput of :meth:`CheckpointManager.load` (verify + deserialize + into the states)
  against a raw read of the same file;
- SIGTERM-to-exit latency of a real worker process.

It is a benchmark, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402
from common import drop_cache, timed  # noqa: E402

from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager  # noqa: E402
from gpu_resilience_worker.logs import StructuredLogger  # noqa: E402

GIB = 1 << 30
TENSOR_BYTES = 64 << 20


class TensorBag(torch.nn.Module):
    """Named tensors as a module's buffers: torch's own ``state_dict`` and ``load_state_dict``, which
    copies into the existing tensors as a model's does.

    :param tensors: the tensors (registered as they are, not copied).
    """

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """:return: the live tensors by name."""
        return dict(self.named_buffers())


def make_state(size_bytes: int, seed: int = 0) -> dict[str, TensorBag]:
    """:return: ``model`` (1/3) and ``optimizer`` (2/3) bags of float32 tensors, ``size_bytes`` in all."""
    generator = torch.Generator().manual_seed(seed)
    count = max(3, round(size_bytes / TENSOR_BYTES))
    per = size_bytes // count // 4
    tensors = [torch.randn(per, generator=generator) for _ in range(count)]
    third = count // 3
    return {
        "model": TensorBag({f"w{i}": t for i, t in enumerate(tensors[:third])}),
        "optimizer": TensorBag({f"m{i}": t for i, t in enumerate(tensors[third:])}),
    }


def empty_like_state(states: dict[str, TensorBag]) -> dict[str, TensorBag]:
    """:return: bags of the same shapes, zero-filled (their pages touched, like a built model)."""
    return {k: TensorBag({n: torch.zeros_like(t) for n, t in bag.tensors.items()}) for k, bag in states.items()}


def state_bytes(states: dict[str, TensorBag]) -> int:
    """:return: the tensor bytes of all bags."""
    return sum(t.numel() * t.element_size() for bag in states.values() for t in bag.tensors.values())


def bench_copy(states: dict[str, TensorBag], repeats: int) -> list[float]:
    """In-memory copy (``clone``) of every tensor: the floor of a copy-based snapshot."""
    results = []
    for _ in range(repeats):
        copies: list[torch.Tensor] = []
        results.append(timed(lambda: copies.extend(t.clone() for b in states.values() for t in b.tensors.values())))
        del copies
    return results


def bench_manager(states: dict[str, TensorBag], folder: Path, repeats: int) -> dict[str, Any]:
    """The manager's async path: blocking per save, and start-to-commit duration; each save is
    followed by a raw write + fsync of as many bytes in the same directory (:func:`raw_write`),
    so that both see the same disk (a shared virtual disk's speed drifts within a minute)."""
    config = CheckpointConfig(folder=str(folder), interval=1, keep_latest_k=2, async_mode=AsyncMode.ASYNC)
    logger = StructuredLogger(open(os.devnull, "w"))
    with CheckpointManager(config, states, logger=logger) as manager:
        blocking, durations, raw = [], [], []
        for step in range(1, repeats + 1):
            blocking.append(timed(lambda: manager.save(step)))
            manager.wait_until_finished()
            durations.append(manager.stats.durations[-1])
            raw.append(raw_write(manager.stats.sizes[-1], folder.parent))
        size = manager.stats.sizes[-1]
    return {"blocking": blocking, "durations": durations, "raw_write": raw, "bytes": size,
            "file": str(folder / f"ckpt-{repeats:08d}.pt")}


def bench_sync_torch_save(states: dict[str, TensorBag], folder: Path, repeats: int) -> list[float]:
    """A synchronous ``torch.save`` + fsync of the same state (blocks for all of it)."""
    path = folder / "torch-save.pt"
    state = {k: b.state_dict() for k, b in states.items()}

    def save() -> None:
        with open(path, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())

    results = [timed(save) for _ in range(repeats)]
    path.unlink()
    return results


def bench_dcp_async(states: dict[str, TensorBag], folder: Path, repeats: int) -> dict[str, Any]:
    """``torch.distributed.checkpoint.async_save`` blocking time (no-dist path), then its total."""
    import torch.distributed.checkpoint as dcp

    state = {k: b.state_dict() for k, b in states.items()}
    blocking, totals = [], []
    for index in range(repeats):
        target = folder / f"dcp-{index}"
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(target), no_dist=True)
        blocking.append(time.perf_counter() - started)
        result = future.upload_completion if hasattr(future, "upload_completion") else future
        result.result()
        totals.append(time.perf_counter() - started)
        shutil.rmtree(target, ignore_errors=True)
    return {"blocking": blocking, "totals": totals}


def bench_sha256(states: dict[str, TensorBag], repeats: int) -> list[float]:
    """sha256 of the tensor bytes alone: the part of a save that a raw write does not do."""
    import hashlib

    views = [memoryview(t.numpy()).cast("B") for b in states.values() for t in b.tensors.values()]

    def digest() -> None:
        hasher = hashlib.sha256()
        for view in views:
            hasher.update(view)

    return [timed(digest) for _ in range(repeats)]


_BLOCK = memoryview(os.urandom(1 << 20) * 64)


def raw_write(size: int, folder: Path) -> float:
    """:return: seconds of a raw sequential write + fsync of ``size`` bytes to a new file in
    ``folder`` (64 MiB writes of random bytes), which is then deleted."""
    path = folder / "raw.bin"

    def write() -> None:
        with open(path, "wb", buffering=0) as handle:
            left = size
            while left:
                left -= handle.write(_BLOCK[: min(left, _BLOCK.nbytes)])
            os.fsync(handle.fileno())

    seconds = timed(write)
    path.unlink()
    return seconds


def bench_load(states: dict[str, TensorBag], folder: Path, data_file: Path, repeats: int) -> dict[str, Any]:
    """The manager's load against a raw read of the data file, both warm and after dropping
    the file's cached pages (cold); then the blocking time of the first save after the last load
    (its snapshot goes into the restore's host copy, which the manager keeps for it)."""
    targets = empty_like_state(states)
    logger = StructuredLogger(open(os.devnull, "w"))
    config = CheckpointConfig(folder=str(folder), interval=1, keep_latest_k=2)
    out: dict[str, list[float]] = {"load_warm": [], "raw_warm": [], "load_cold": [], "raw_cold": []}
    for index in range(repeats):
        for kind in ("warm", "cold"):
            if kind == "cold":
                drop_cache(data_file)
            out[f"raw_{kind}"].append(timed(lambda: data_file.read_bytes()))
            if kind == "cold":
                drop_cache(data_file)
            with CheckpointManager(config, targets, logger=logger) as manager:
                out[f"load_{kind}"].append(timed(manager.load))
                if kind == "cold" and index == repeats - 1:
                    out["resumed_first_blocking"] = [timed(lambda: manager.save(manager.loaded_step + 1))]
            manager = None
            gc.collect()  # a discarded manager's buffers go here, not inside the next timed load
    equal = all(torch.equal(targets[k].tensors[n], t) for k, b in states.items() for n, t in b.tensors.items())
    return {**out, "bit_identical": equal}


def bench_sigterm(workdir: Path, grace: float = 10.0) -> dict[str, Any]:
    """SIGTERM-to-exit latency of a real worker (flushing a final checkpoint), and its exit code."""
    import numpy as np

    rng = np.random.default_rng(0)
    data = workdir / "data.npz"
    np.savez(data, x_train=rng.standard_normal((512, 64), dtype=np.float32),
             y_train=rng.integers(0, 10, 512), x_test=rng.standard_normal((64, 64), dtype=np.float32),
             y_test=rng.integers(0, 10, 64))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "worker"), str(REPO)]), "CLOUD_RUN_JOB": "bench", "PREEMPTION_GRACE_SECONDS": str(grace)}
    args = [sys.executable, "-m", "gpu_resilience_trainer", "train", "--checkpoint-dir", str(workdir / "ckpt"),
            "--data", str(data), "--steps", "100000", "--checkpoint-every", "20", "--step-delay", "0.005"]
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if '"checkpoint saved"' in line:
            break
    time.sleep(0.3)
    started = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    tail = proc.stdout.read()
    code = proc.wait()
    latency = time.perf_counter() - started
    flushed = [json.loads(l).get("step") for l in tail.splitlines() if '"checkpoint saved"' in l]
    return {"seconds": latency, "exit_code": code, "flushed_step": flushed[-1] if flushed else None,
            "grace_seconds": grace}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def summarize(raw: dict[str, Any], size: int) -> dict[str, Any]:
    """:return: medians, throughputs and target verdicts from the raw measurements."""
    steady = raw["manager"]["blocking"][1:] or raw["manager"]["blocking"]
    async_block = _median(steady)
    copy = _median(raw["copy"])
    dcp_block = _median(raw["dcp"]["blocking"])
    file_bytes = raw["manager"]["bytes"]
    write_rate = file_bytes / _median(raw["manager"]["durations"])
    raw_write_rate = file_bytes / _median(raw["raw_write"])
    load = raw["load"]
    load_rate, raw_read_rate = file_bytes / _median(load["load_warm"]), file_bytes / _median(load["raw_warm"])
    cold_rate, raw_cold_rate = file_bytes / _median(load["load_cold"]), file_bytes / _median(load["raw_cold"])
    sig = raw["sigterm"]
    return {
        "state_bytes": size, "file_bytes": file_bytes,
        "async_blocking_s": async_block, "async_first_blocking_s": raw["manager"]["blocking"][0],
        "resumed_first_blocking_s": load["resumed_first_blocking"][0],
        "sync_torch_save_fsync_s": _median(raw["sync"]), "copy_s": copy, "dcp_async_blocking_s": dcp_block,
        "dcp_async_total_s": _median(raw["dcp"]["totals"]),
        "sha256_s": _median(raw["sha256"]), "raw_write_s": _median(raw["raw_write"]),
        "async_save_total_s": _median(raw["manager"]["durations"]),
        "write_MBps": write_rate / 1e6, "raw_write_MBps": raw_write_rate / 1e6,
        "load_warm_MBps": load_rate / 1e6, "raw_read_warm_MBps": raw_read_rate / 1e6,
        "load_cold_MBps": cold_rate / 1e6, "raw_read_cold_MBps": raw_cold_rate / 1e6,
        "load_bit_identical": load["bit_identical"],
        "sigterm_exit_s": sig["seconds"], "sigterm_exit_code": sig["exit_code"],
        "sigterm_flushed_step": sig["flushed_step"],
        "targets": {
            "async blocking <= 1.25 x in-memory copy": async_block <= 1.25 * copy,
            "async blocking <= async_save blocking": async_block <= dcp_block,
            "write >= 80% of raw write+fsync": write_rate >= 0.8 * raw_write_rate,
            "load >= 80% of raw read (warm)": load_rate >= 0.8 * raw_read_rate,
            "load >= 80% of raw read (cold)": cold_rate >= 0.8 * raw_cold_rate,
            "SIGTERM exit 143 within the grace period": sig["exit_code"] == 143 and sig["seconds"] < sig["grace_seconds"],
        },
    }


def render(summary: dict[str, Any]) -> str:
    """:return: the summary as a plain-text table."""
    s = summary
    rows = [
        ("state / file size", f"{s['state_bytes'] / GIB:.2f} GiB / {s['file_bytes'] / GIB:.2f} GiB"),
        ("async save: blocking (steady; first; first after a resume)",
         f"{s['async_blocking_s']:.3f} s; {s['async_first_blocking_s']:.3f} s; {s['resumed_first_blocking_s']:.3f} s"),
        ("in-memory copy (clone)", f"{s['copy_s']:.3f} s"),
        ("dcp.async_save: blocking (total)", f"{s['dcp_async_blocking_s']:.3f} s ({s['dcp_async_total_s']:.3f} s)"),
        ("sync torch.save + fsync", f"{s['sync_torch_save_fsync_s']:.3f} s"),
        ("write: async save vs raw write+fsync", f"{s['write_MBps']:.0f} vs {s['raw_write_MBps']:.0f} MB/s"),
        ("  async save start-to-commit; raw write+fsync; sha256 alone",
         f"{s['async_save_total_s']:.3f} s; {s['raw_write_s']:.3f} s; {s['sha256_s']:.3f} s"),
        ("load (warm) vs raw read", f"{s['load_warm_MBps']:.0f} vs {s['raw_read_warm_MBps']:.0f} MB/s"),
        ("load (cold) vs raw read", f"{s['load_cold_MBps']:.0f} vs {s['raw_read_cold_MBps']:.0f} MB/s"),
        ("SIGTERM to exit", f"{s['sigterm_exit_s']:.3f} s, exit {s['sigterm_exit_code']}, flushed step {s['sigterm_flushed_step']}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append("")
    lines += [f"[{'met' if ok else 'MISSED'}] {target}" for target, ok in s["targets"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark. :return: 0 (targets missed are reported, not an error)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1)")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions of each measurement (default 5)")
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default a temp dir)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="folder of the JSON result")
    args = parser.parse_args(argv)
    size = int(args.size_gib * GIB)
    machine = common.machine_info()
    workdir = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    try:
        states = make_state(size)
        size = state_bytes(states)
        raw: dict[str, Any] = {"copy": bench_copy(states, args.repeats)}
        raw["manager"] = bench_manager(states, workdir / "manager", args.repeats)
        raw["sync"] = bench_sync_torch_save(states, workdir, args.repeats)
        raw["dcp"] = bench_dcp_async(states, workdir, args.repeats)
        raw["sha256"] = bench_sha256(states, args.repeats)
        raw["raw_write"] = raw["manager"]["raw_write"]
        raw["load"] = bench_load(states, workdir / "manager", Path(raw["manager"]["file"]), max(1, args.repeats - 1))
        raw["sigterm"] = bench_sigterm(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(raw, size)
    machine["load_at_end"] = common.load()
    print("\n".join(common.machine_lines(machine)) + f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print(render(summary))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = out / "checkpoint.json"
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "argv": sys.argv[1:], **machine}
    result.write_text(json.dumps({"summary": summary, "raw": raw, "meta": meta}, indent=1, default=str) + "\n")
    print(f"\nwrote {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

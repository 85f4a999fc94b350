"""Snapshot ("staging") of a training state into host memory: the worker's buffers against torch's.

``python benchmarks/bench_staging.py [--size-gib 1.0] [--repeats 5]`` prints a table and writes
``benchmarks/results/staging.json``. An asynchronous save blocks the training loop only while the
state is copied into host memory; this compares the ways to make that copy, on one state of
``--size-gib`` (one third model, two thirds optimizer, float32 tensors of 64 MiB, as in
``bench_checkpoint.py``) plus the small non-tensor entries a real state has:

- ``worker SnapshotBuffers``: :class:`gpu_resilience_worker.snapshot.SnapshotBuffers`, buffers kept from one save
  to the next (pinned when the source is on CUDA);
- ``torch BlockingAsyncStager(cache)``: ``torch.distributed.checkpoint.staging.BlockingAsyncStager``
  with ``cache_staged_state_dict=True``, its cached (pinned) copy reused;
- ``torch DefaultStager(sync, no pin/shm)``: ``DefaultStager`` with every option that needs an
  accelerator or shared memory off, staging in the caller;
- ``torch BlockingAsyncStager(no cache)``: a new CPU copy every time (the floor without reuse).

For each: the first snapshot (allocation included), the median of the later ones (steady state,
what every save but the first costs), the host memory it keeps between saves, and whether the copy
equals the source. A way that raises on this machine is reported with its error, not skipped.
It is a benchmark, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402
from bench_checkpoint import GIB, make_state  # noqa: E402
from gpu_resilience_worker.snapshot import SnapshotBuffers  # noqa: E402


def training_like_state(size: int) -> dict[str, Any]:
    """:return: a nested state dict of ``size`` tensor bytes with the non-tensor entries of a
    real one (optimizer ``param_groups``, an RNG state tensor, a step counter)."""
    bags = make_state(size)
    return {
        "model": bags["model"].state_dict(),
        "optimizer": {"state": bags["optimizer"].state_dict(),
                      "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0, 1]}]},
        "train_state": {"step": 1234, "rng": torch.get_rng_state()},
    }


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """:return: every tensor in a nested structure, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def equal(source: Any, copy: Any) -> bool:
    """:return: whether ``copy`` holds the same tensors (bit for bit) in separate memory."""
    pairs = list(zip(tensors_of(source), tensors_of(copy)))
    return len(pairs) == len(tensors_of(source)) and all(
        a.data_ptr() != b.data_ptr() and torch.equal(a, b) for a, b in pairs
    )


def candidates() -> dict[str, Callable[[], Callable[[Any], Any]]]:
    """:return: name -> factory of a ``stage(state) -> host copy`` function (one instance per run)."""
    from torch.distributed.checkpoint import staging

    def ours() -> Callable[[Any], Any]:
        return SnapshotBuffers().copy

    def blocking_cached() -> Callable[[Any], Any]:
        return staging.BlockingAsyncStager(cache_staged_state_dict=True).stage

    def default_sync() -> Callable[[Any], Any]:
        options = staging.StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                         use_async_staging=False, use_non_blocking_copy=False)
        return staging.DefaultStager(options).stage

    def blocking_fresh() -> Callable[[Any], Any]:
        return staging.BlockingAsyncStager(cache_staged_state_dict=False).stage

    return {
        "worker SnapshotBuffers": ours,
        "torch BlockingAsyncStager(cache)": blocking_cached,
        "torch DefaultStager(sync, no pin/shm)": default_sync,
        "torch BlockingAsyncStager(no cache)": blocking_fresh,
    }


def measure(factory: Callable[[], Callable[[Any], Any]], state: Any, repeats: int) -> dict[str, Any]:
    """Stage ``state`` ``repeats`` times with one instance, changing the source in between.

    :return: ``first_s``, ``steady_s`` (median of the rest), ``kept_bytes`` and ``equal``, or
        ``error`` when the way raises.
    """
    try:
        stage = factory()
        times, copy = [], None
        for round_ in range(repeats):
            for tensor in tensors_of(state):
                tensor.add_(1.0) if tensor.is_floating_point() else None
            started = time.perf_counter()
            copy = stage(state)
            times.append(time.perf_counter() - started)
        kept = sum(t.numel() * t.element_size() for t in tensors_of(copy))
        return {"times": times, "first_s": times[0], "steady_s": statistics.median(times[1:] or times),
                "kept_bytes": kept, "equal": equal(state, copy)}
    except Exception as exc:  # a way that does not run here is a result too
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str] | None = None) -> int:
    """Run the comparison. :return: 0."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1)")
    parser.add_argument("--repeats", type=int, default=5, help="snapshots per way, the first allocates (default 5)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="folder of the JSON result")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (the first snapshot allocates)")
    machine = common.machine_info()
    state = training_like_state(int(args.size_gib * GIB))
    size = sum(t.numel() * t.element_size() for t in tensors_of(state))
    results = {name: measure(factory, state, args.repeats) for name, factory in candidates().items()}
    machine["load_at_end"] = common.load()

    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", r["error"][:60]])
            continue
        rows.append([name, f"{r['first_s']:.3f}", f"{r['steady_s']:.3f}", f"{size / r['steady_s'] / 1e6:.0f}",
                     f"{r['kept_bytes'] / 1e6:.0f}", "yes" if r["equal"] else "NO"])
    print("\n".join(common.machine_lines(machine)) + f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CUDA {'yes' if torch.cuda.is_available() else 'no'}; state {size / 1e6:.0f} MB, {args.repeats} snapshots each\n")
    print(common.table(["way", "first s", "steady s", "steady MB/s", "kept MB", "copy equal"], rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "staging.json"
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "bytes": size, "argv": sys.argv[1:], **machine}
    path.write_text(json.dumps({"results": results, "meta": meta}, indent=1) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

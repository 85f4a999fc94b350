"""The processes ``bench_save_cost.py`` measures, each started as ``bench_save_cost.py --child``:
a training loop that checkpoints (or writes the state's bytes raw) on an interval
(:func:`child_train`), and a restarted worker from its start to its first step after a restore
(:func:`child_restart`); and the states they hold.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

from common import MIB, REPO, raw_read, raw_write


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
                manager.digest = args.digest
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

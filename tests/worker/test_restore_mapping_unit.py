"""How a restore maps its in-memory copy: shared only where torch scopes the choice to one
thread, never writing back, and training continuing bit-exactly."""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import gpu_resilience_worker.checkpoint as checkpoint
from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager
from gpu_resilience_worker.logs import StructuredLogger


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 4)
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


def _manager(folder: Path, states: dict[str, Any]) -> CheckpointManager:
    config = CheckpointConfig(folder=str(folder), interval=1, keep_latest_k=2, async_mode=AsyncMode.DISABLED)
    return CheckpointManager(config, states, logger=StructuredLogger(open(os.devnull, "w")))


def _train(model: Net, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 6, generator=generator)).pow(2).mean().backward()
        optimizer.step()


def _saved_run(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """:return: the model state saved at step 3, and the state 4 steps later."""
    torch.manual_seed(2)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, optimizer, 3, seed=5)
    with _manager(folder, {"model": model, "optimizer": optimizer}) as manager:
        manager.save(3, force=True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, optimizer, 4, seed=6)
    return saved, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("thread_local", [True, False], ids=["shared mapping", "private mapping"])
def test_a_restore_trains_on_bit_exactly_and_never_writes_back(tmp_path: Path, monkeypatch, thread_local: bool) -> None:
    """Adam keeps its restored moments as loaded (in the mapping); what training writes there
    never reaches the checkpoint: a second restore gives the saved values again."""
    monkeypatch.setattr(checkpoint, "_THREAD_LOCAL_MMAP", thread_local)
    saved, expected = _saved_run(tmp_path)
    for _ in range(2):
        fresh = Net()
        optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
        with _manager(tmp_path, {"model": fresh, "optimizer": optimizer}) as manager:
            assert manager.load() and manager.loaded_step == 3
        for key, tensor in fresh.state_dict().items():
            assert torch.equal(tensor, saved[key]), key
        _train(fresh, optimizer, 4, seed=6)
        for key, tensor in fresh.state_dict().items():
            assert torch.equal(tensor, expected[key]), key


def test_torch_of_this_venv_scopes_the_mmap_option_per_thread(monkeypatch) -> None:
    monkeypatch.setattr(checkpoint, "_THREAD_LOCAL_MMAP", None)
    scoped = isinstance(getattr(torch.serialization, "set_default_mmap_options", None), type)
    assert checkpoint._shared_mmap_is_thread_local() is scoped
    assert torch.serialization.get_default_mmap_options() == mmap.MAP_PRIVATE


def test_a_process_wide_mmap_option_is_never_set_to_shared(tmp_path: Path, monkeypatch) -> None:
    """torch 2.5-2.11 keep the option in one process-wide value: a restore must not set it to
    MAP_SHARED even for a moment after the one probe (another thread's own mmap load would map
    its file shared), so it maps privately."""
    value = {"flags": mmap.MAP_PRIVATE}
    changes: list[int] = []

    class ProcessWide:
        def __init__(self, flags: int) -> None:
            self.prev, value["flags"] = value["flags"], flags
            changes.append(flags)

        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            value["flags"] = self.prev

    monkeypatch.setattr(torch.serialization, "set_default_mmap_options", ProcessWide)
    monkeypatch.setattr(torch.serialization, "get_default_mmap_options", lambda: value["flags"])
    monkeypatch.setattr(checkpoint, "_THREAD_LOCAL_MMAP", None)
    assert checkpoint._shared_mmap_is_thread_local() is False
    probe_changes = len(changes)
    saved, _ = _saved_run(tmp_path)
    fresh = Net()
    with _manager(tmp_path, {"model": fresh}) as manager:
        assert manager.load()
    assert len(changes) == probe_changes  # the restore itself changed nothing
    assert all(torch.equal(t, saved[k]) for k, t in fresh.state_dict().items())

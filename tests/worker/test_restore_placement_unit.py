"""A restore writes each storage a module's tensor will hold straight into that tensor as the
bytes arrive: the result is bit-exact, and a checkpoint found torn, corrupt or interrupted after
some storages were placed leaves the modules exactly as they were."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager, RestoreInterrupted
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.restore_copy import ModulePlacement


class Net(torch.nn.Module):
    """Parameters, buffers, a weight shared by two layers and a non-contiguous buffer."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.first = torch.nn.Linear(width, width)
        self.norm = torch.nn.BatchNorm1d(width)
        self.second = torch.nn.Linear(width, width)
        self.second.weight = self.first.weight  # tied: two entries, one storage
        self.register_buffer("transposed", torch.randn(width, 3).t())  # saved with its strides

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.norm(self.first(x))) + self.transposed.sum()


def _manager(folder: Path, states: dict[str, Any], should_stop=None) -> CheckpointManager:
    config = CheckpointConfig(folder=str(folder), interval=1, keep_latest_k=3, async_mode=AsyncMode.DISABLED)
    return CheckpointManager(config, states, logger=StructuredLogger(open(os.devnull, "w")), should_stop=should_stop)


def _train(model: Net, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, model.first.in_features, generator=generator)).pow(2).mean().backward()
        optimizer.step()


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _saved(folder: Path, steps: tuple[int, ...] = (3,), width: int = 64) -> tuple[list[dict], dict, dict]:
    """Train and save at ``steps``: :return: the model's state at each, and the model and
    optimizer states 4 steps after the last (the reference a resumed run must reach)."""
    torch.manual_seed(2)
    model = Net(width)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    saved, done = [], 0
    with _manager(folder, {"model": model, "optimizer": optimizer}) as manager:
        for step in steps:
            _train(model, optimizer, step - done, seed=step)
            done = step
            manager.save(step, force=True)
            saved.append(_snapshot(model))
    _train(model, optimizer, 4, seed=99)
    return saved, _snapshot(model), optimizer.state_dict()


def test_a_module_restore_places_its_storages_and_trains_on_bit_exactly(tmp_path: Path, placements) -> None:
    (saved,), expected, expected_optimizer = _saved(tmp_path)
    torch.manual_seed(7)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    pointers = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with _manager(tmp_path, {"model": model, "optimizer": optimizer}) as manager:
        assert manager.load() is True
    assert _equal(_snapshot(model), saved)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == pointers  # loaded in place
    assert model.second.weight is model.first.weight
    # Every contiguous module tensor was placed (the tied weight once); the transposed buffer,
    # the optimizer's moments and its step counters were not.
    entries = [k for k, v in model.state_dict().items() if v.is_contiguous() and k != "second.weight"]
    assert len(placements) == 1 and len(placements[0]) == len(entries)
    _train(model, optimizer, 4, seed=99)
    assert _equal(_snapshot(model), expected)
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], expected_optimizer["state"][0]["exp_avg"])


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the archive's end: every storage was placed before the digest fails
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("older", [True, False], ids=["falls back", "nothing to fall back to"])
def test_a_checkpoint_found_corrupt_after_its_storages_were_placed_changes_nothing(tmp_path: Path, placements,
                                                                                  put_back, older: bool) -> None:
    saved, _, _ = _saved(tmp_path, steps=(3, 6) if older else (6,), width=2048)  # 16 MiB weights
    _flip_last_byte(tmp_path / "ckpt-00000006.pt")
    torch.manual_seed(7)
    model = Net(2048)
    before = _snapshot(model)
    with _manager(tmp_path, {"model": model}) as manager:
        assert manager.load() is older
    assert _equal(_snapshot(model), saved[0] if older else before)
    assert len(placements) == (1 if older else 0)
    assert len(put_back) == 1 and put_back[0] >= 16 << 20  # the (tied) weight had been placed


def test_a_stop_during_a_placing_restore_leaves_the_modules_as_they_were(tmp_path: Path, put_back) -> None:
    _saved(tmp_path, width=2048)
    torch.manual_seed(7)
    model = Net(2048)
    before = _snapshot(model)
    asked = []

    def should_stop() -> bool:  # the first 8 MiB read placed part of the weight, then a stop
        asked.append(1)
        return len(asked) > 2

    with _manager(tmp_path, {"model": model}, should_stop=should_stop) as manager:
        with pytest.raises(RestoreInterrupted):
            manager.load()
    assert _equal(_snapshot(model), before)
    assert len(put_back) == 1 and 0 < put_back[0] < 16 << 20  # a part of the first weight


def test_a_placement_torch_would_not_read_is_undone_before_the_load(tmp_path: Path, monkeypatch, placements,
                                                                     put_back) -> None:
    """Where torch's own reader of the archive disagrees with a placement, every placed part is
    swapped back (the copy gets the file's bytes, the module its own) and the load copies."""
    (saved,), _, _ = _saved(tmp_path)
    monkeypatch.setattr(ModulePlacement, "check", lambda self, copy: False)
    model = Net()
    with _manager(tmp_path, {"model": model}) as manager:
        assert manager.load() is True
    assert _equal(_snapshot(model), saved) and placements == [{}] and put_back == [-1]


class Holder:
    """Not a module: keeps the tensors it is given, and shows them in its state."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.tensors = dict(state)


def test_a_storage_another_state_also_holds_is_loaded_not_placed(tmp_path: Path, placements) -> None:
    """The holder would keep the loaded tensor, a view of the copy where a placement leaves the
    module's previous bytes: that storage is loaded from the copy, the others are placed."""
    torch.manual_seed(3)
    model = Net()
    with _manager(tmp_path, {"model": model, "holder": Holder({"w": model.first.bias.detach()})}) as manager:
        manager.save(1, force=True)
    saved = _snapshot(model)
    torch.manual_seed(4)
    again = Net()
    holder = Holder({})
    with _manager(tmp_path, {"model": again, "holder": holder}) as manager:
        assert manager.load() is True
    assert _equal(_snapshot(again), saved) and torch.equal(holder.tensors["w"], saved["first.bias"])
    entries = [k for k, v in again.state_dict().items() if v.is_contiguous() and k not in ("second.weight", "first.bias")]
    assert len(placements) == 1 and len(placements[0]) == len(entries)

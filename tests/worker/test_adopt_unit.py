"""Zero-copy restore: a CPU module takes over the loaded tensors' memory, and only where safe."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from gpu_resilience_worker.adopt import adopt_loaded_tensors, adoptable
from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager
from gpu_resilience_worker.logs import StructuredLogger


def _same(make: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return make(), make()


_ALIASES: list[torch.Tensor] = []


def _shared_target() -> tuple[torch.Tensor, torch.Tensor]:
    target = torch.nn.Parameter(torch.zeros(4))
    _ALIASES.append(target.data)  # e.g. an EMA helper keeping the parameter's memory
    return target, torch.zeros(4)


CASES: list[tuple[str, Callable[[], tuple[Any, Any]], bool]] = [
    ("plain float tensors", lambda: _same(lambda: torch.zeros(4, 3)), True),
    ("a parameter takes a loaded tensor", lambda: (torch.nn.Parameter(torch.zeros(4)), torch.ones(4)), True),
    ("integer buffer", lambda: _same(lambda: torch.zeros(5, dtype=torch.int64)), True),
    ("scalar", lambda: _same(lambda: torch.tensor(1.5)), True),
    ("other dtype", lambda: (torch.zeros(4), torch.zeros(4, dtype=torch.float64)), False),
    ("other shape", lambda: (torch.zeros(4, 3), torch.zeros(3, 4)), False),
    ("other strides", lambda: (torch.zeros(4, 3), torch.zeros(3, 4).t()), False),
    ("target is a view into a larger storage", lambda: (torch.zeros(8)[4:], torch.zeros(4)), False),
    ("target is the head of a larger storage", lambda: (torch.zeros(8)[:4], torch.zeros(4)), False),
    ("source is a view into a larger storage", lambda: (torch.zeros(4), torch.zeros(8)[:4]), False),
    ("source requires grad", lambda: (torch.zeros(4), torch.zeros(4, requires_grad=True)), False),
    ("source is a Parameter", lambda: (torch.zeros(4), torch.nn.Parameter(torch.zeros(4))), False),
    ("target not on the CPU", lambda: (torch.empty(4, device="meta"), torch.zeros(4)), False),
    ("source not on the CPU", lambda: (torch.zeros(4), torch.empty(4, device="meta")), False),
    ("sparse source", lambda: (torch.zeros(4), torch.zeros(4).to_sparse()), False),
    ("conjugated source", lambda: (torch.zeros(2, dtype=torch.complex64), torch.zeros(2, dtype=torch.complex64).conj()), False),
    ("quantized target", lambda: (torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.qint8),
                                  torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.qint8)), False),
    ("target's storage shared with another tensor", lambda: _shared_target(), False),
    ("not a tensor", lambda: (torch.zeros(4), [0.0] * 4), False),
    ("missing", lambda: (torch.zeros(4), None), False),
]


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("name, make, expected", CASES, ids=[c[0] for c in CASES])
def test_adoptable(name: str, make: Callable[[], tuple[Any, Any]], expected: bool) -> None:
    target, source = make()
    assert adoptable(target, source) is expected


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 4)
        self.norm = torch.nn.BatchNorm1d(4)  # buffers: running_mean, running_var, num_batches_tracked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


def _round_trip(state: dict[str, Any], path: Path) -> dict[str, Any]:
    torch.save(state, path)
    return torch.load(path, weights_only=True)


def test_a_module_shares_the_loaded_memory_and_keeps_its_parameter_objects(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = Net()
    loaded = _round_trip(saved.state_dict(), tmp_path / "net.pt")
    model = Net()
    weight = model.linear.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    adopted = adopt_loaded_tensors(model, loaded)
    model.load_state_dict(loaded)
    assert adopted == sum(t.nbytes for t in loaded.values())
    assert model.linear.weight is weight and optimizer.param_groups[0]["params"][0] is weight
    for key, tensor in model.state_dict().items():
        assert tensor.data_ptr() == loaded[key].data_ptr(), key
        assert torch.equal(tensor, saved.state_dict()[key]), key
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()  # trains in place, in the adopted memory
    assert model.linear.weight.data_ptr() == loaded["linear.weight"].data_ptr()
    assert not torch.equal(model.linear.weight, saved.linear.weight)


def test_tied_weights_stay_tied_and_separate_ones_stay_separate(tmp_path: Path) -> None:
    class Tied(torch.nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            if tie:
                self.head.weight = self.embed.weight

    torch.manual_seed(1)
    tied = Tied(tie=True)
    loaded = _round_trip(tied.state_dict(), tmp_path / "tied.pt")  # one storage under two keys
    assert loaded["embed.weight"].data_ptr() == loaded["head.weight"].data_ptr()

    again = Tied(tie=True)
    adopt_loaded_tensors(again, loaded)
    again.load_state_dict(loaded)
    assert again.head.weight is again.embed.weight
    assert again.embed.weight.data_ptr() == loaded["embed.weight"].data_ptr()

    untied = Tied(tie=False)  # the same checkpoint into separate parameters: no aliasing made
    adopt_loaded_tensors(untied, loaded)
    untied.load_state_dict(loaded)
    assert untied.embed.weight.data_ptr() != untied.head.weight.data_ptr()
    with torch.no_grad():
        untied.head.weight.add_(1.0)
    assert torch.equal(untied.embed.weight, tied.embed.weight)


def test_parameters_tied_through_shared_memory_stay_tied(tmp_path: Path) -> None:
    """Two Parameter objects on one storage (``nn.Parameter(other.data)``) are tied only while
    they keep that memory: neither is re-pointed, both are copied into."""
    model = Net()
    model.extra = torch.nn.Parameter(model.linear.weight.data)  # the same memory, another Parameter
    torch.manual_seed(3)
    saved = Net()
    saved.extra = torch.nn.Parameter(saved.linear.weight.data)
    loaded = _round_trip(saved.state_dict(), tmp_path / "shared.pt")
    adopted = adopt_loaded_tensors(model, loaded)
    model.load_state_dict(loaded)
    assert model.extra.data_ptr() == model.linear.weight.data_ptr()
    assert adopted == sum(t.nbytes for k, t in loaded.items() if k not in ("extra", "linear.weight"))
    with torch.no_grad():
        model.extra.add_(1.0)
    assert torch.equal(model.linear.weight, saved.linear.weight + 1.0)


def test_only_modules_adopt(tmp_path: Path) -> None:
    loaded = _round_trip({"w": torch.ones(3)}, tmp_path / "w.pt")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    assert adopt_loaded_tensors(optimizer, loaded) == 0
    assert adopt_loaded_tensors(Net(), None) == 0


def _manager(folder: Path, states: dict[str, Any]) -> CheckpointManager:
    config = CheckpointConfig(folder=str(folder), interval=1, keep_latest_k=2, async_mode=AsyncMode.DISABLED)
    return CheckpointManager(config, states, logger=StructuredLogger(open(os.devnull, "w")))


def _train(model: Net, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 6, generator=generator)).pow(2).mean().backward()
        optimizer.step()


def test_a_restore_adopts_trains_on_bit_exactly_and_never_writes_back(tmp_path: Path) -> None:
    """Through the checkpoint manager: the model takes over the restored copy, Adam keeps its
    restored moments, training continues bit-exactly, and what training writes into that memory
    never reaches the checkpoint (a second restore gives the saved values)."""
    torch.manual_seed(2)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, optimizer, 3, seed=5)
    with _manager(tmp_path, {"model": model, "optimizer": optimizer}) as manager:
        manager.save(3, force=True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, optimizer, 4, seed=6)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    for _ in range(2):  # the second restore proves the first one's training stayed in memory
        fresh = Net()
        fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
        with _manager(tmp_path, {"model": fresh, "optimizer": fresh_optimizer}) as manager:
            assert manager.load() and manager.loaded_step == 3
            assert manager.adopted_bytes == sum(t.nbytes for t in saved.values())
        for key, tensor in fresh.state_dict().items():
            assert torch.equal(tensor, saved[key]), key
        _train(fresh, fresh_optimizer, 4, seed=6)
        for key, tensor in fresh.state_dict().items():
            assert torch.equal(tensor, expected[key]), key

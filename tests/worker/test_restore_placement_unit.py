"""A restore writes each storage a module's tensor will hold straight into that tensor as the
bytes arrive: the result is bit-exact, and a checkpoint found torn, corrupt or interrupted after
some storages were placed leaves the modules exactly as they were."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager, RestoreInterrupted
from gpu_resilience_worker.fastio import DIGEST_CHUNK, chunk_digests
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.restore_copy import LocalCopy, ModulePlacement
from gpu_resilience_worker.task_folder import CommitRecord


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


@pytest.fixture
def placements(monkeypatch) -> list[dict[str, Any]]:
    """The storages each kept restore placed (recorded when the placement is kept)."""
    kept: list[dict[str, Any]] = []
    original = LocalCopy.keep_placed

    def keep_placed(self: LocalCopy) -> None:
        kept.append(dict(self.placed))
        original(self)

    monkeypatch.setattr(LocalCopy, "keep_placed", keep_placed)
    return kept


@pytest.fixture
def put_back(monkeypatch) -> list[int]:
    """The bytes each closed copy gave back to the modules (placed, then not kept); -1 for a swap back."""
    given: list[int] = []
    original = LocalCopy._give_back

    def spy(self: LocalCopy, swap: bool = False) -> None:
        given.append(-1 if swap else self.displaced_bytes)
        original(self, swap)

    monkeypatch.setattr(LocalCopy, "_give_back", spy)
    return given


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


# --- what a breaker found: each case restores exactly what torch.load + load_state_dict gives ---

class Many(torch.nn.Module):
    """A pickle of about 60 KiB (beyond the first 64 KiB step of the stream's search)."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(500):
            self.register_buffer(f"a_buffer_with_a_long_name_{i:04d}", torch.randn(4))


class KeepsItsHead(torch.nn.Module):
    """A ``load_state_dict`` that keeps its own head (fine-tuning)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def load_state_dict(self, state, strict=True, assign=False):  # noqa: ANN001
        return super().load_state_dict({k: v for k, v in state.items() if not k.startswith("head.")}, strict=False)


class Swaps(torch.nn.Module):
    """A load pre-hook that exchanges two entries (a layout migration)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 16, bias=False)
        self._register_load_state_dict_pre_hook(Swaps._swap)

    @staticmethod
    def _swap(state, prefix, *args) -> None:  # noqa: ANN001
        state[prefix + "gate.weight"], state[prefix + "up.weight"] = state[prefix + "up.weight"], state[prefix + "gate.weight"]


class Calibrated(torch.nn.Module):
    """An extra state that hands out a live tensor and declines to be restored."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.calibration = torch.nn.Linear(4, 4), torch.randn(8)

    def get_extra_state(self) -> torch.Tensor:
        return self.calibration

    def set_extra_state(self, state: Any) -> None:
        pass


class TiedWhenLoaded(torch.nn.Module):
    """Saved untied, loaded tied: torch's copies (x, then y) decide what the tied weight holds."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        for i in range(9):  # storage keys 0-8: x's is "9", y's "10"
            setattr(self, f"p{i}", torch.nn.Parameter(torch.randn(4)))
        self.x, self.y = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False)
        if tie:
            self.y.weight = self.x.weight


class OddStorage(torch.nn.Module):
    """A float32 buffer on a 10-byte storage (torch writes 10 bytes for 2 elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("odd", torch.randint(0, 255, (10,), dtype=torch.uint8)[:8].view(torch.float32))
        self.lin = torch.nn.Linear(4, 4)


class Gaps(torch.nn.Module):
    """An empty buffer (its record has no data descriptor) and a 16-bit unsigned one (rebuilt another way)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.register_buffer("empty", torch.zeros(0))
        self.register_buffer("counts", torch.arange(6).to(torch.uint16))
        self.last = torch.nn.Linear(4, 4)


def _raw(state: dict[str, Any]) -> dict[str, Any]:
    """Names, dtypes, shapes and bytes (NaN payloads included) of a state dict's tensors."""
    return {k: (v.dtype, tuple(v.shape), bytes(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
            if isinstance(v, torch.Tensor) else v for k, v in state.items()}


@pytest.mark.parametrize("make, saved_as, placed", [
    (Many, Many, 500),
    (KeepsItsHead, KeepsItsHead, 0),
    (Swaps, Swaps, 0),
    (Calibrated, Calibrated, 2),
    (TiedWhenLoaded, lambda: TiedWhenLoaded(tie=False), 9),
    (OddStorage, OddStorage, 0),
    (Gaps, Gaps, 4),  # records 0 and 1 are theirs (the root's buffers first): the four after are placed
], ids=["a pickle past 64 KiB", "a load_state_dict of its own", "a load pre-hook", "an extra state",
        "tied only when loaded", "a storage longer than its tensor", "an empty and a uint16 buffer"])
def test_a_restore_gives_what_torch_load_and_load_state_dict_give(tmp_path: Path, placements, make, saved_as,
                                                                   placed: int) -> None:
    torch.manual_seed(1)
    with _manager(tmp_path, {"model": saved_as()}) as manager:
        manager.save(1, force=True)
    torch.manual_seed(2)
    reference = make()
    reference.load_state_dict(torch.load(tmp_path / "ckpt-00000001.pt", weights_only=True, mmap=True)["model"])
    torch.manual_seed(2)
    model = make()
    with _manager(tmp_path, {"model": model}) as manager:
        assert manager.load() is True
    assert _raw(model.state_dict()) == _raw(reference.state_dict())
    assert len(placements[0]) == placed


def test_a_load_state_dict_that_raises_keeps_what_it_loaded_as_torch_does(tmp_path: Path) -> None:
    """A strict load with a parameter the checkpoint lacks: torch copies every entry it has, then
    raises; the placed entries stay too (no module left half old, half new)."""
    torch.manual_seed(1)
    with _manager(tmp_path, {"model": Net()}) as manager:
        manager.save(1, force=True)
    saved = torch.load(tmp_path / "ckpt-00000001.pt", weights_only=True)["model"]
    model = Net()
    model.extra = torch.nn.Parameter(torch.zeros(2))
    with _manager(tmp_path, {"model": model}) as manager, pytest.raises(RuntimeError, match="extra"):
        manager.load()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


class Unseekable(io.RawIOBase):
    def __init__(self) -> None:
        self.written = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.written += data
        return len(data)


class Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p, self.q = torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(64))


def test_a_pickle_the_central_directory_does_not_name_is_never_trusted(tmp_path: Path, placements) -> None:
    """A crafted archive whose first record is a pickle mapping the two storages the other way
    round, named ``data.pkl`` in its local header only, with a commit record made to match: torch
    reads the other pickle, and so does the restore (every placement swapped back)."""
    torch.manual_seed(1)
    state = Pair().state_dict()
    real, swapped = io.BytesIO(), io.BytesIO()
    torch.save({"model": state}, real)
    torch.save({"model": {"q": state["q"], "p": state["p"]}}, swapped)  # q on storage 0, p on 1
    out = Unseekable()  # so that zipfile streams as torch does: a data descriptor after each record
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/xata.pkl", zipfile.ZipFile(io.BytesIO(swapped.getvalue())).read("archive/data.pkl"))
        with zipfile.ZipFile(io.BytesIO(real.getvalue())) as source:
            for name in source.namelist():
                archive.writestr(name, source.read(name))
    data = bytes(out.written).replace(b"archive/xata.pkl", b"archive/data.pkl", 1)  # the local header's name only
    (tmp_path / "ckpt-00000001.pt").write_bytes(data)
    manager = _manager(tmp_path, {})
    manager._write_record(CommitRecord.of_chunks(1, len(data), chunk_digests(data, DIGEST_CHUNK, manager.digest),
                                                 "2026-01-01T00:00:00Z", digest=manager.digest))
    model = Pair()
    with _manager(tmp_path, {"model": model}) as manager:
        assert manager.load() is True
    assert _raw(model.state_dict()) == _raw(state) and placements == [{}]


def test_an_interrupt_during_the_read_puts_back_what_was_placed(tmp_path: Path, put_back) -> None:
    _saved(tmp_path, width=2048)
    model = Net(2048)
    before = _snapshot(model)
    asked = []

    def should_stop() -> bool:  # a KeyboardInterrupt raised between two reads, as a SIGINT would
        asked.append(1)
        if len(asked) > 2:
            raise KeyboardInterrupt
        return False

    with _manager(tmp_path, {"model": model}, should_stop=should_stop) as manager:
        with pytest.raises(KeyboardInterrupt):
            manager.load()
    assert _equal(_snapshot(model), before) and put_back and put_back[0] > 0


def test_the_first_background_save_after_a_restore_writes_no_state_s_live_tensor(tmp_path: Path) -> None:
    """A storage the checkpoint shares between a module entry and another state, which keeps the
    loaded tensor: it is never a snapshot buffer."""
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 8)
    with _manager(tmp_path, {"model": model, "holder": Holder({"w": model.bias.detach()})}) as manager:
        manager.save(1, force=True)
    live, holder = torch.nn.Linear(8, 8), Holder({})
    config = CheckpointConfig(folder=str(tmp_path), interval=1, keep_latest_k=3, async_mode=AsyncMode.ASYNC)
    with CheckpointManager(config, {"model": live, "holder": holder},
                           logger=StructuredLogger(open(os.devnull, "w"))) as manager:
        assert manager.load() is True
        kept = holder.tensors["w"].clone()
        with torch.no_grad():
            live.bias.fill_(7.0)
        manager.save(2)
        manager.wait_until_finished()
    assert torch.equal(holder.tensors["w"], kept)

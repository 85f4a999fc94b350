"""What breakers found in the placing restore: each case restores exactly what ``torch.load`` and
``load_state_dict`` give, and an interrupt, a raising load or a crafted archive leaves no module torn."""

from __future__ import annotations

import functools
import io
import os
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager
from gpu_resilience_worker.fastio import DIGEST_CHUNK, chunk_digests
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.restore_copy import ModulePlacement
from gpu_resilience_worker.task_folder import CommitRecord
from tests.worker.test_restore_placement_unit import Holder, Net, _equal, _manager, _saved, _snapshot


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


class OwnLoadOnTheInstance(torch.nn.Sequential):
    """A ``load_state_dict`` set on the instance that keeps the last layer."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        keep = super().load_state_dict
        self.load_state_dict = lambda state, strict=True: keep({k: v for k, v in state.items() if k[0] != "1"},
                                                               strict=False)


def _swapping(load):
    @functools.wraps(load)
    def swapped(self, state, prefix, *args):  # noqa: ANN001
        state[prefix + "a"], state[prefix + "b"] = state[prefix + "b"], state[prefix + "a"]
        return load(self, state, prefix, *args)
    return swapped


class WrappedTorchLoad(torch.nn.Module):
    """A ``_load_from_state_dict`` of its own that looks like torch's (``functools.wraps``)."""

    _load_from_state_dict = _swapping(torch.nn.Module._load_from_state_dict)

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))


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
    (OwnLoadOnTheInstance, OwnLoadOnTheInstance, 0),
    (WrappedTorchLoad, WrappedTorchLoad, 0),
    (Gaps, Gaps, 4),  # records 0 and 1 are theirs (the root's buffers first): the four after are placed
], ids=["a pickle past 64 KiB", "a load_state_dict of its own", "a load pre-hook", "an extra state",
        "tied only when loaded", "a storage longer than its tensor", "a load_state_dict on the instance",
        "a wrapped _load_from_state_dict", "an empty and a uint16 buffer"])
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


def test_an_interrupt_after_the_read_puts_back_what_was_placed(tmp_path: Path, monkeypatch) -> None:
    """A KeyboardInterrupt (a SIGINT) while the placement is checked, before the load."""
    _saved(tmp_path)
    model = Net()
    before = _snapshot(model)

    def interrupted(self: ModulePlacement, copy: Any) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(ModulePlacement, "check", interrupted)
    with _manager(tmp_path, {"model": model}) as manager, pytest.raises(KeyboardInterrupt):
        manager.load()
    assert _equal(_snapshot(model), before)


def test_a_record_the_central_directory_points_at_placed_bytes_is_loaded_as_torch_reads_it(tmp_path: Path,
                                                                                          placements) -> None:
    """A crafted archive (commit record made to match) whose central directory sends another state's
    storage to a module's storage: torch gives both the module's saved bytes, and so does the restore
    (every placement swapped back: no record may share a byte with another)."""
    torch.manual_seed(1)
    with _manager(tmp_path, {"model": torch.nn.Linear(8, 8, bias=False), "holder": Holder({"h": torch.randn(64)})}) as m:
        m.save(1, force=True)
    path = tmp_path / "ckpt-00000001.pt"
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        first = {i.filename.rsplit("/", 2)[-2] + "/" + i.filename.rsplit("/", 1)[-1]: i for i in archive.infolist()}
    entry = struct.unpack_from("<I", data, data.rindex(b"PK\x05\x06") + 16)[0]
    while data[entry : entry + 4] == b"PK\x01\x02":  # data/1's entry now points at data/0's local header
        name_length, extra, comment = struct.unpack_from("<HHH", data, entry + 28)
        if data[entry + 46 : entry + 46 + name_length].endswith(b"/data/1"):
            struct.pack_into("<I", data, entry + 42, first["data/0"].header_offset)
        entry += 46 + name_length + extra + comment
    path.write_bytes(bytes(data))
    manager = _manager(tmp_path, {})
    manager._write_record(CommitRecord.of_chunks(1, len(data), chunk_digests(bytes(data), DIGEST_CHUNK, manager.digest),
                                                 "2026-01-01T00:00:00Z", digest=manager.digest))
    saved = torch.load(path, weights_only=True)
    model, holder = torch.nn.Linear(8, 8, bias=False), Holder({})
    with _manager(tmp_path, {"model": model, "holder": holder}) as manager:
        assert manager.load() is True
    assert torch.equal(holder.tensors["h"], saved["holder"]["h"]) and torch.equal(model.weight, saved["model"]["weight"])
    assert placements == [{}]

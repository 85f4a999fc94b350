"""Unit tests of asynchronous saves: CPU snapshot, one in flight, errors re-raised, failed saves
counted at their outcomes (three in a row end the attempt)."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager, CheckpointSaveError
from gpu_resilience_worker.errors import OutOfSpaceError, SavesFailingError, WorkerError
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.policies import (
    GIVE_UP, GO_ON, MAX_FAILED_SAVES_IN_A_ROW, OUT_OF_SPACE, failed_save_verdict,
)
from gpu_resilience_worker.storage import LocalStorage

from tests.worker.test_checkpoint_unit import Box, ListLog


class GatedStorage(LocalStorage):
    """Local storage whose data writes wait for a gate, or fail on demand."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.fail = False

    def write(self, path: str, data: bytes, *, atomic: bool = False) -> None:
        if path.endswith(".pt"):
            assert self.gate.wait(10)
            if self.fail:
                raise OSError("disk full")
        super().write(path, data, atomic=atomic)


def _manager(folder: Path, box: Box, storage: GatedStorage, log: ListLog | None = None) -> CheckpointManager:
    config = CheckpointConfig(folder=str(folder), interval=10, async_mode=AsyncMode.ASYNC)
    return CheckpointManager(config, {"box": box}, storage=storage, logger=StructuredLogger(log or ListLog()))


def test_async_save_snapshots_state_at_call_time(tmp_path: Path) -> None:
    storage, box = GatedStorage(), Box(1.0)
    with _manager(tmp_path, box, storage) as manager:
        assert manager.save(10) is True and manager.in_flight
        box.tensor += 100  # training goes on while the save is in flight
        assert manager.latest_step() is None  # not committed yet
        storage.gate.set()
        assert manager.wait_until_finished() is True
        assert manager.latest_step() == 10 and manager.last_saved_step == 10
    restored = Box()
    with _manager(tmp_path, restored, storage) as manager:
        assert manager.load()
    assert restored.tensor.item() == 1.0


def test_at_most_one_save_in_flight(tmp_path: Path) -> None:
    storage = GatedStorage()
    with _manager(tmp_path, Box(), storage) as manager:
        manager.save(10)
        assert manager.wait_until_finished(timeout=0.05) is False
        threading.Timer(0.2, storage.gate.set).start()
        manager.save(20)  # waits for step 10 first
        assert manager.valid_steps() == [10]
        manager.wait_until_finished()
        assert manager.valid_steps() == [20, 10]


def test_background_error_is_reraised(tmp_path: Path) -> None:
    storage = GatedStorage()
    storage.fail = True
    storage.gate.set()
    log = ListLog()
    manager = _manager(tmp_path, Box(), storage, log)
    manager.save(10)
    with pytest.raises(CheckpointSaveError, match="disk full"):
        manager.wait_until_finished()
    # logged by the background thread when it failed, not only when re-raised
    failed = [r for r in log.records if r["message"] == "background checkpoint save failed"]
    assert failed and failed[0]["severity"] == "ERROR" and failed[0]["step"] == 10
    assert manager.failed_saves == 1 and manager.latest_step() is None
    storage.fail = False
    assert manager.save(20) is True  # the next save goes ahead
    manager.close()
    assert manager.latest_step() == 20


def test_forced_save_is_synchronous(tmp_path: Path) -> None:
    storage = GatedStorage()
    storage.gate.set()
    with _manager(tmp_path, Box(torch.pi), storage) as manager:
        assert manager.save(7, force=True) is True
        assert not manager.in_flight and manager.latest_step() == 7


class _FullFile:
    """A file on a full disk: it takes ``room`` bytes, then every write fails with ENOSPC (and no
    path, as ``os.write``'s error has none)."""

    def __init__(self, handle, room: int) -> None:
        self._handle, self._room = handle, room

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= size
        return self._handle.write(data)

    def fileno(self) -> int:
        return self._handle.fileno()


class FullDiskStorage(LocalStorage):
    """Local storage whose checkpoint data files, while ``full``, fail after their first 4 KiB
    with ENOSPC: inside ``torch.save``'s write of a record of 1 MiB or more (see :func:`_big_box`)."""

    def __init__(self) -> None:
        self.full = True

    def write(self, path: str, data, *, atomic: bool = False) -> None:
        if self.full and callable(data) and path.endswith(".pt"):
            produce = data
            data = lambda handle: produce(_FullFile(handle, 4096))  # noqa: E731 - one use
        super().write(path, data, atomic=atomic)


def _big_box() -> Box:
    """A state whose tensor (1 MiB) torch writes as one record, past the writer's small buffer."""
    box = Box()
    box.tensor = torch.zeros(1 << 18)
    return box


def test_a_save_failing_inside_torch_save_reports_the_write_error_with_its_path(tmp_path: Path) -> None:
    """The write's ENOSPC, with the file's path, is what the caller gets: not the error of torch's
    zip writer ending its archive after the failed write ("unexpected pos")."""
    with _manager(tmp_path, _big_box(), FullDiskStorage()) as manager:
        with pytest.raises(CheckpointSaveError) as raised:
            manager.save(10, force=True)
    cause = raised.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(cause)
    assert cause.filename == manager.path(10)
    assert "No space left on device" in str(raised.value) and manager.path(10) in str(raised.value)
    assert "unexpected pos" not in str(raised.value)
    assert not (tmp_path / "ckpt-00000010.pt").exists()  # its space is given back


def test_background_saves_on_a_full_disk_end_the_attempt_after_three_failures_with_74(tmp_path: Path) -> None:
    """Driven as a training loop drives it (a failed save is reported and training goes on): each
    background save's failure is counted when the save ends, not undone when the next one starts,
    so the third in a row (reported at the save after it) raises the exit-74 error."""
    log, reported = ListLog(), []
    manager = _manager(tmp_path, _big_box(), FullDiskStorage(), log)
    with pytest.raises(WorkerError) as raised:
        for step in range(1, 201):
            try:
                manager.save(step)
            except CheckpointSaveError:
                reported.append(step)
    assert raised.value.exit_code == 74  # EX_IOERR
    assert str(tmp_path) in raised.value.reason and "No space left on device" in raised.value.reason
    # saves of 10, 30, 50 started and failed; 20 and 40 reported the failures before them
    assert reported == [20, 40] and step == 60 and manager.failed_saves == 3
    failed = [r for r in log.records if r["message"] == "background checkpoint save failed"]
    assert [(r["step"], r["failed_in_a_row"]) for r in failed] == [(10, 1), (30, 2), (50, 3)]


@pytest.mark.parametrize(("outcomes", "ends_at"), [
    ("FFF", 3),  # three in a row
    ("FFRFF", None),  # a commit in between starts the count again
    ("FFRFFF", 6),
    ("RFFRFRFF", None),
])
@pytest.mark.parametrize("mode", [AsyncMode.ASYNC, AsyncMode.DISABLED])
def test_failed_saves_in_a_row_count_outcomes(tmp_path: Path, outcomes: str, ends_at, mode) -> None:
    """Each save's outcome (F: failed on a full disk, R: committed), background or not, awaited
    before the next: the attempt ends at the third failure in a row, and only there."""
    storage = FullDiskStorage()
    config = CheckpointConfig(folder=str(tmp_path), interval=10, async_mode=mode)
    manager = CheckpointManager(config, {"box": _big_box()}, storage=storage, logger=StructuredLogger(ListLog()))
    ended = None
    for index, outcome in enumerate(outcomes, start=1):
        storage.full = outcome == "F"
        try:
            manager.save(10 * index)
            manager.wait_until_finished()
        except CheckpointSaveError:
            assert outcome == "F"
        except OutOfSpaceError:
            ended = index
            break
    assert ended == ends_at
    assert manager.failed_in_a_row == (3 if ends_at else len(outcomes) - 1 - outcomes.rindex("R"))


@pytest.mark.parametrize(("in_a_row", "error", "verdict"), [
    (1, OSError(errno.ENOSPC, "No space left on device"), GO_ON),
    (2, OSError(errno.EIO, "Input/output error"), GO_ON),
    (3, OSError(errno.ENOSPC, "No space left on device"), OUT_OF_SPACE),
    (3, OSError(errno.EDQUOT, "Disk quota exceeded"), OUT_OF_SPACE),
    (4, OSError(errno.ENOSPC, "No space left on device"), OUT_OF_SPACE),
    (3, OSError(errno.EIO, "Input/output error"), GIVE_UP),  # a mount's EIO may pass: retryable
    (3, OSError("no errno"), GIVE_UP),
    (3, RuntimeError("torch failed"), GIVE_UP),
])
def test_failed_save_verdict(in_a_row: int, error: BaseException, verdict: str) -> None:
    assert MAX_FAILED_SAVES_IN_A_ROW == 3
    assert failed_save_verdict(in_a_row, error) == verdict


def test_three_failures_of_another_kind_end_the_attempt_retryably(tmp_path: Path) -> None:
    storage = GatedStorage()
    storage.fail = True
    storage.gate.set()
    config = CheckpointConfig(folder=str(tmp_path), interval=1, async_mode=AsyncMode.DISABLED)
    manager = CheckpointManager(config, {"box": Box()}, storage=storage, logger=StructuredLogger(ListLog()))
    for step in (1, 2):
        with pytest.raises(CheckpointSaveError):
            manager.save(step)
    with pytest.raises(SavesFailingError, match="3 checkpoint saves failed in a row") as raised:
        manager.save(3)
    assert not isinstance(raised.value, (CheckpointSaveError, WorkerError))  # the catch-all's exit 1


def test_resilient_loop_on_a_full_disk_returns_74_after_three_background_saves_failed(tmp_path: Path) -> None:
    """The other driver of the rule: ``ResilientLoop`` with background saves stops at the third
    failure in a row (reported at step 60), returns 74 and writes ``FATAL``, instead of training
    to the end and failing the final save with exit 1."""
    from gpu_resilience_worker.loop import ResilientLoop

    log = ListLog()
    loop = ResilientLoop({"box": _big_box()}, total_steps=200, folder=str(tmp_path / "run"), checkpoint_every=10,
                         storage=FullDiskStorage(), env={}, argv=["own-loop"], logger=StructuredLogger(log))
    assert loop.run(lambda step: 0.5) == 74
    assert loop.step == 60
    marker = json.loads((tmp_path / "run" / "FATAL").read_text())
    assert "No space left on device" in marker["reason"] and str(tmp_path / "run") in marker["reason"]


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(8, 16, generator=generator)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(16, 4)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def test_a_resumed_manager_snapshots_into_the_restored_copy_and_never_into_the_live_state(tmp_path: Path) -> None:
    """After a restore, the loaded tensors the states copied (the model's) are the first snapshot's
    buffers, and those the states kept (Adam's moments) are not: a save started after the resume
    holds the values at its call, though training changes the live state before it is written."""
    config = CheckpointConfig(folder=str(tmp_path), interval=1, async_mode=AsyncMode.ASYNC)
    storage, logger = GatedStorage(), StructuredLogger(ListLog())
    storage.gate.set()
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    with CheckpointManager(config, {"model": model, "optimizer": optimizer}, storage=storage, logger=logger) as manager:
        manager.save(1, force=True)
    model, optimizer = _model_and_optimizer()
    with CheckpointManager(config, {"model": model, "optimizer": optimizer}, storage=storage, logger=logger) as manager:
        assert manager.load()
        assert manager._snapshots.nbytes == sum(p.numel() * p.element_size() for p in model.state_dict().values())
        _step(model, optimizer, 2)
        expected = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                    "moments": [v.clone() for s in optimizer.state.values() for v in s.values()]}
        storage.gate.clear()
        assert manager.save(2)  # the snapshot is taken here; its write waits for the gate
        _step(model, optimizer, 3)  # training changes the live state while the save is in flight
        storage.gate.set()
        manager.wait_until_finished()
    restored, restored_optimizer = _model_and_optimizer()
    with CheckpointManager(config, {"model": restored, "optimizer": restored_optimizer}, storage=storage,
                           logger=logger) as manager:
        assert manager.load() and manager.loaded_step == 2
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in expected["model"].items())
    got = [v for s in restored_optimizer.state.values() for v in s.values()]
    assert len(got) == len(expected["moments"]) and all(torch.equal(a, b) for a, b in zip(got, expected["moments"]))


def test_a_restore_adopts_no_tensor_of_a_state_that_is_not_a_module(tmp_path: Path) -> None:
    """What any other object's ``load_state_dict`` keeps is unknown: its loaded tensors are freed."""
    config = CheckpointConfig(folder=str(tmp_path), interval=1, async_mode=AsyncMode.ASYNC)
    storage, logger = LocalStorage(), StructuredLogger(ListLog())
    with CheckpointManager(config, {"box": Box(3.0)}, storage=storage, logger=logger) as manager:
        manager.save(1, force=True)
    with CheckpointManager(config, {"box": Box()}, storage=storage, logger=logger) as manager:
        assert manager.load() and manager._snapshots.nbytes == 0

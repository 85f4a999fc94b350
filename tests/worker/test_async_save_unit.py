"""Unit tests of asynchronous saves: CPU snapshot, one in flight, errors re-raised."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager, CheckpointSaveError
from gpu_resilience_worker.logs import StructuredLogger
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


def test_trainer_goes_on_after_a_failed_save_and_stops_after_three_in_a_row() -> None:
    from types import SimpleNamespace

    from gpu_resilience_worker.config import config_from_args
    from gpu_resilience_worker.preemption import PreemptionWatcher
    from gpu_resilience_worker.train import MAX_FAILED_SAVES_IN_A_ROW, Trainer

    class Failing:
        failed_saves = 0

        def save(self, step: int, *, force: bool = False) -> bool:
            self.failed_saves += 1
            raise CheckpointSaveError("disk full")

    log = ListLog()
    trainer = Trainer(config_from_args(["train"], {}), StructuredLogger(log), PreemptionWatcher())
    parts, manager = SimpleNamespace(state=SimpleNamespace(checkpoints=0)), Failing()
    for step in range(1, MAX_FAILED_SAVES_IN_A_ROW):
        assert trainer._save(manager, parts, step) is False  # logged, training goes on
    with pytest.raises(CheckpointSaveError):
        trainer._save(manager, parts, MAX_FAILED_SAVES_IN_A_ROW)
    assert [r["failed_in_a_row"] for r in log.records if r["message"].startswith("checkpoint save failed")] == [1, 2, 3]

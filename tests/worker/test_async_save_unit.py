"""Unit tests of asynchronous saves: CPU snapshot, one in flight, errors re-raised."""

from __future__ import annotations

import threading
import time
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


# --- tensors an optimizer steps are written from live memory (gpu_resilience_worker.stepguard) ---

WIDE = 1024 * 512 * 4  # bytes of the second layer's weight: the only tensor over LIVE_MIN_BYTES


def _model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 512))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(4, 8)).square().mean().backward()  # changes batch-norm statistics too
    optimizer.step()


def _torch_manager(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   storage: LocalStorage, log: ListLog | None = None,
                   should_stop: object = None) -> CheckpointManager:
    config = CheckpointConfig(folder=str(folder), interval=10, async_mode=AsyncMode.ASYNC)
    return CheckpointManager(config, {"model": model, "optimizer": optimizer}, storage=storage,
                             logger=StructuredLogger(log or ListLog()), should_stop=should_stop)


def _prime(manager: CheckpointManager, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           storage: GatedStorage, *, copy_rate: float = 1.0) -> None:
    """A first save (a copy: nothing is measured before it, and its copy allocates, so it gives
    no copy rate), a step after it (the window), then a copy rate so slow that writing live
    pays; the gate closed again."""
    storage.gate.set()
    manager.save(10)
    manager.wait_until_finished()
    _train_step(model, optimizer)
    assert manager.stats.serialize and not manager.stats.copy_rates
    manager.stats.copy_rates.append(copy_rate)
    storage.gate.clear()


def _saved_live_bytes(log: ListLog) -> list[int]:
    return [r["live_bytes"] for r in log.records if r["message"] == "checkpoint saved" and r.get("mode") == "async"]


def _saved(folder: Path, step: int) -> dict:
    model, optimizer = _model_and_optimizer(seed=99)
    with _torch_manager(folder, model, optimizer, LocalStorage()) as manager:
        assert manager.load(step)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _current(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    import copy

    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict())}


def _same(saved: dict, expected: dict) -> bool:
    from gpu_resilience_worker.state import state_digest

    return state_digest(saved) == state_digest(expected)


@pytest.mark.parametrize(
    ("serialize", "window", "live_bytes", "copy_rate", "expected"),
    [
        (None, 0.5, 100, 10.0, False),  # the first save: nothing measured
        (2.0, None, 100, 10.0, False),  # no step seen after a save yet
        (2.0, 0.5, 100, None, False),  # no copy measured
        (2.0, 0.5, 0, 10.0, False),  # nothing to write live
        (2.0, 0.5, 100, 10.0, True),  # waits 1.5 s against a 10 s copy
        (12.0, 0.5, 100, 10.0, False),  # slow storage: waits 11.5 s against 10 s
        (10.5, 0.5, 100, 10.0, False),  # a tie copies
        (0.1, 0.5, 100, 1e9, True),  # written within the window: no wait at all
    ],
)
def test_live_write_pays(serialize: float | None, window: float | None, live_bytes: int,
                         copy_rate: float | None, expected: bool) -> None:
    from gpu_resilience_worker.stepguard import live_write_pays

    assert live_write_pays(serialize, window, live_bytes, copy_rate) is expected


def test_optimizer_tensors_are_written_live_and_the_next_step_waits(tmp_path: Path) -> None:
    storage, log = GatedStorage(), ListLog()
    model, optimizer = _model_and_optimizer()
    with _torch_manager(tmp_path, model, optimizer, storage, log) as manager:
        _prime(manager, model, optimizer, storage)
        expected = _current(model, optimizer)
        assert manager.save(20) is True and manager.in_flight
        stepped = threading.Event()
        trainer = threading.Thread(target=lambda: (_train_step(model, optimizer), stepped.set()))
        trainer.start()
        assert not stepped.wait(0.5)  # optimizer.step() waits for the save to read its tensors
        storage.gate.set()
        assert stepped.wait(10)
        trainer.join()
        manager.wait_until_finished()
        assert manager.stats.blocking[-1] >= 0.4  # the wait counts as the save's blocking time
    # the first save copied everything; the second wrote the wide weight and its two moments live
    assert _saved_live_bytes(log) == [0, 3 * WIDE]
    # the checkpoint holds the state at the save, not the step after it (nor its batch-norm update)
    assert _same(_saved(tmp_path, 20), expected)
    assert not _same(_saved(tmp_path, 20), _current(model, optimizer))


def test_slow_storage_copies_instead_of_holding_the_step(tmp_path: Path) -> None:
    storage, log = GatedStorage(), ListLog()
    model, optimizer = _model_and_optimizer()
    with _torch_manager(tmp_path, model, optimizer, storage, log) as manager:
        _prime(manager, model, optimizer, storage, copy_rate=1e12)  # a copy costs nothing
        manager.stats.serialize.append(30.0)  # and the last write took 30 s
        manager.save(20)
        _train_step(model, optimizer)  # not held: the save has its own copy
        storage.gate.set()
    assert _saved_live_bytes(log) == [0, 0]


def test_an_in_place_change_outside_step_fails_the_save_and_later_saves_copy(tmp_path: Path) -> None:
    storage, log = GatedStorage(), ListLog()
    model, optimizer = _model_and_optimizer()
    with _torch_manager(tmp_path, model, optimizer, storage, log) as manager:
        _prime(manager, model, optimizer, storage)
        manager.save(20)
        with torch.no_grad():  # e.g. the first half of a sharpness-aware minimization step
            model[2].weight.add_(1.0)
        storage.gate.set()
        with pytest.raises(CheckpointSaveError, match=r"outside optimizer\.step\(\)"):
            manager.wait_until_finished()
        assert manager.valid_steps() == [10]  # nothing mixed is kept
        storage.gate.clear()
        manager.stats.copy_rates.append(1.0)  # live would pay, but it is off for this manager now
        manager.save(30)
        expected = _current(model, optimizer)
        with torch.no_grad():
            model[2].weight.add_(1.0)  # a copy was taken: this no longer matters
        storage.gate.set()
        manager.wait_until_finished()
    assert _same(_saved(tmp_path, 30), expected)
    assert _saved_live_bytes(log) == [0, 0]  # the failed save logged no "checkpoint saved"
    failed = [r for r in log.records if r["message"] == "background checkpoint save failed"]
    assert len(failed) == 1 and failed[0]["step"] == 20


def test_a_stop_lets_a_waiting_step_go_on_and_the_save_in_flight_is_dropped(tmp_path: Path) -> None:
    storage, stop = GatedStorage(), threading.Event()
    model, optimizer = _model_and_optimizer()
    with _torch_manager(tmp_path, model, optimizer, storage, should_stop=stop.is_set) as manager:
        _prime(manager, model, optimizer, storage)
        manager.save(20)
        stepped = threading.Event()
        trainer = threading.Thread(target=lambda: (_train_step(model, optimizer), stepped.set()))
        trainer.start()
        assert not stepped.wait(0.3)
        stop.set()  # SIGTERM: the attempt must not sit in optimizer.step() past its grace period
        assert stepped.wait(2)
        trainer.join()
        storage.gate.set()
        with pytest.raises(CheckpointSaveError, match="a stop let optimizer.step"):
            manager.wait_until_finished()
        assert manager.latest_step() == 10


def test_copy_mode_and_states_without_an_optimizer_copy_everything(tmp_path: Path) -> None:
    for mode, states in ((AsyncMode.COPY, "both"), (AsyncMode.ASYNC, "model only")):
        storage, log = GatedStorage(), ListLog()
        model, optimizer = _model_and_optimizer()
        config = CheckpointConfig(folder=str(tmp_path / mode.value / states.replace(" ", "-")),
                                  interval=10, async_mode=mode)
        objects = {"model": model, "optimizer": optimizer} if states == "both" else {"model": model}
        with CheckpointManager(config, objects, storage=storage, logger=StructuredLogger(log)) as manager:
            _prime(manager, model, optimizer, storage)
            manager.save(20)
            _train_step(model, optimizer)  # not waited for: the save has a copy
            storage.gate.set()
        assert _saved_live_bytes(log) == [0, 0], (mode, states)


def test_an_optimizer_holding_a_tensor_off_the_cpu_is_never_written_live() -> None:
    from gpu_resilience_worker.stepguard import LIVE_MIN_BYTES, StepGuard

    cpu = torch.nn.Parameter(torch.zeros(LIVE_MIN_BYTES // 4))
    alone = StepGuard({"optimizer": torch.optim.SGD([cpu], lr=0.1)})
    assert list(alone.live_storages().values()) == [LIVE_MIN_BYTES]
    other = torch.nn.Parameter(torch.zeros(4, device="meta"))  # stands in for a CUDA tensor
    mixed = StepGuard({"optimizer": torch.optim.SGD([cpu, other], lr=0.1)})
    assert mixed.live_storages() == {}
    small = StepGuard({"optimizer": torch.optim.SGD([torch.nn.Parameter(torch.zeros(8))], lr=0.1)})
    assert small.live_storages() == {}
    for guard in (alone, mixed, small):
        guard.close()


def test_close_removes_the_step_hooks(tmp_path: Path) -> None:
    storage = GatedStorage()
    storage.gate.set()
    model, optimizer = _model_and_optimizer()
    hooks = len(optimizer._optimizer_step_pre_hooks)
    with _torch_manager(tmp_path, model, optimizer, storage) as manager:
        assert len(optimizer._optimizer_step_pre_hooks) == hooks + 1
        manager.save(10)
    assert len(optimizer._optimizer_step_pre_hooks) == hooks


def test_a_run_writing_live_resumes_bit_identically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Live writes chosen for every save after the first (the decision forced; the mechanism is
    real): a run stopped after step 7 and resumed from its newest checkpoint ends with the bits
    of an uninterrupted one."""
    import gpu_resilience_worker.checkpoint as checkpoint_module
    from gpu_resilience_worker.state import state_digest

    monkeypatch.setattr(checkpoint_module, "live_write_pays", lambda *args: True)

    def train(folder: Path, steps: range, resume: bool) -> tuple[dict, list[int]]:
        model, optimizer = _model_and_optimizer()
        config = CheckpointConfig(folder=str(folder), interval=2, async_mode=AsyncMode.ASYNC)
        with CheckpointManager(config, {"model": model, "optimizer": optimizer},
                               logger=StructuredLogger(ListLog())) as manager:
            if resume:
                assert manager.load() and manager.loaded_step == steps.start
            for step in steps:
                torch.manual_seed(1000 + step)  # the batch of this step
                _train_step(model, optimizer)
                manager.save(step + 1)
            manager.wait_until_finished()
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, manager.stats.live

    reference, live = train(tmp_path / "reference", range(12), resume=False)
    assert live == [3 * WIDE] * 6  # every save, the first too (the decision is forced)
    train(tmp_path / "stopped", range(7), resume=False)  # its newest checkpoint: step 6
    resumed, _ = train(tmp_path / "stopped", range(6, 12), resume=True)
    assert state_digest(resumed) == state_digest(reference)


class DataSGD(torch.optim.SGD):
    """An optimizer whose step writes through ``.data``, as custom and C++ kernels do: no
    version counter sees it."""

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.data.add_(param.grad.data, alpha=-group["lr"])


def test_a_stop_fails_the_save_in_flight_even_when_the_step_writes_through_data(tmp_path: Path) -> None:
    storage, stop = GatedStorage(), threading.Event()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 1024), torch.nn.Linear(1024, 512))
    optimizer = DataSGD(model.parameters(), lr=0.1)
    with _torch_manager(tmp_path, model, optimizer, storage, should_stop=stop.is_set) as manager:
        _prime(manager, model, optimizer, storage)
        manager.save(20)
        trainer = threading.Thread(target=_train_step, args=(model, optimizer))
        trainer.start()
        time.sleep(0.2)
        stop.set()
        trainer.join(2)
        assert not trainer.is_alive()
        storage.gate.set()
        with pytest.raises(CheckpointSaveError, match="a stop let optimizer.step"):
            manager.wait_until_finished()
        assert manager.valid_steps() == [10]


def test_a_failing_stop_check_counts_as_a_stop(tmp_path: Path) -> None:
    storage = GatedStorage()

    def unreachable() -> bool:
        raise OSError("deadline service unreachable")

    model, optimizer = _model_and_optimizer()
    with _torch_manager(tmp_path, model, optimizer, storage, should_stop=unreachable) as manager:
        _prime(manager, model, optimizer, storage)
        manager.save(20)
        _train_step(model, optimizer)  # goes on, does not raise
        storage.gate.set()
        with pytest.raises(CheckpointSaveError, match="a stop let optimizer.step"):
            manager.wait_until_finished()


def test_a_save_thread_that_cannot_start_releases_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = GatedStorage()
    model, optimizer = _model_and_optimizer()
    with _torch_manager(tmp_path, model, optimizer, storage) as manager:
        _prime(manager, model, optimizer, storage)

        def refuse(self: threading.Thread) -> None:
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(threading.Thread, "start", refuse)
        with pytest.raises(CheckpointSaveError, match="could not start"):
            manager.save(20)
        monkeypatch.undo()
        done = threading.Event()
        threading.Thread(target=lambda: (_train_step(model, optimizer), done.set()), daemon=True).start()
        assert done.wait(5)  # not held by a save that never ran
        storage.gate.set()
        assert manager.save(30) is True
        manager.wait_until_finished()
        assert manager.valid_steps() == [30, 10] and manager.failed_saves == 1


def test_frozen_parameters_and_storages_outside_the_states_are_not_counted_live() -> None:
    from gpu_resilience_worker.stepguard import LIVE_MIN_BYTES, StepGuard

    trained = torch.nn.Parameter(torch.zeros(LIVE_MIN_BYTES // 4))
    frozen = torch.nn.Parameter(torch.zeros(LIVE_MIN_BYTES // 4), requires_grad=False)
    guard = StepGuard({"optimizer": torch.optim.SGD([trained, frozen], lr=0.1)})
    assert set(guard.live_storages()) == {trained.untyped_storage().data_ptr()}
    guard.close()


def test_live_bytes_count_what_the_states_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpu_resilience_worker.checkpoint as checkpoint_module

    monkeypatch.setattr(checkpoint_module, "live_write_pays", lambda *args: True)
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer)
    config = CheckpointConfig(folder=str(tmp_path), interval=10, async_mode=AsyncMode.ASYNC)
    with CheckpointManager(config, {"optimizer": optimizer}, logger=StructuredLogger(ListLog())) as manager:
        manager.save(10)  # the parameters are not among the states: only the two moments are written
    assert manager.stats.live == [2 * WIDE]

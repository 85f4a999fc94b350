"""AsyncMode.AUTO: the cost accounting of saves, the choice between a background save and one on
the training thread, and the manager acting on it (a fake clock stands in for the step times)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.policies import REMEASURE_AFTER, SaveCostMeter, choose_save_mode

from tests.worker.test_async_save_unit import GatedStorage
from tests.worker.test_checkpoint_unit import Box, ListLog

ASYNC, SYNC = AsyncMode.ASYNC, AsyncMode.DISABLED


@pytest.mark.parametrize("async_costs, sync_costs, syncs_in_a_row, expected", [
    ([], [], 0, ASYNC),                           # nothing measured: background first
    ([5.0], [], 0, ASYNC),                        # no synchronous figure to compare with
    ([0.2], [3.0], 0, ASYNC),                     # the write overlaps training (GPU, slow volume)
    ([1.5], [1.0], 0, SYNC),                      # training had no core to spare
    ([1.0], [1.0], 0, ASYNC),                     # a tie goes to the background
    ([9.0, 1.0, 1.0], [1.2, 1.2, 1.2], 0, ASYNC),  # the median of the last three, not one outlier
    ([1.0, 1.0, 9.0, 9.0], [2.0, 2.0, 2.0], 0, SYNC),  # only the last three count
    ([1.5], [1.0, 9.0, 1.0, 1.0], 0, SYNC),
    ([1.5], [1.0], REMEASURE_AFTER - 1, SYNC),
    ([1.5], [1.0], REMEASURE_AFTER, ASYNC),       # measured again after a run of synchronous saves
])
def test_choose_save_mode(async_costs: list[float], sync_costs: list[float], syncs_in_a_row: int,
                          expected: AsyncMode) -> None:
    assert choose_save_mode(async_costs, sync_costs, syncs_in_a_row) is expected


def test_meter_counts_copy_wait_and_the_excess_of_steps_in_flight() -> None:
    meter = SaveCostMeter()
    for seconds in (1.0, 1.2, 0.8):  # free steps: median 1.0
        meter.step(seconds, began_in_flight=False)
    meter.started_async(0.3)
    meter.step(1.5, began_in_flight=True)
    meter.step(0.9, began_in_flight=True)  # faster than the median: noise, it cancels
    meter.waited(0.25)
    assert meter.close_async(sync_estimate=2.0) == pytest.approx(0.3 + 0.4 + 0.25)
    assert meter.async_costs == [pytest.approx(0.95)] and meter.sync_costs == [2.0]
    assert meter.close_async() is None  # recorded once
    meter.step(5.0, began_in_flight=True)  # no save open: a free step
    assert meter.free_steps[-1] == 5.0


def test_meter_never_counts_a_negative_excess() -> None:
    meter = SaveCostMeter(free_steps=[1.0, 1.0])
    meter.started_async(0.2)
    meter.step(0.5, began_in_flight=True)
    assert meter.close_async() == pytest.approx(0.2)


def test_meter_without_free_steps_measures_against_the_fastest_step_of_the_save() -> None:
    meter = SaveCostMeter()
    meter.started_async(0.1)
    for seconds in (2.0, 3.0, 2.5):
        meter.step(seconds, began_in_flight=True)
    assert meter.close_async() == pytest.approx(0.1 + 1.0 + 0.5)


def test_meter_counts_synchronous_runs_and_resets_them_with_a_background_save() -> None:
    meter = SaveCostMeter()
    meter.saved_sync(1.0, interval=True)
    meter.saved_sync(2.0, interval=False)  # a forced save: a cost, but not an interval choice
    assert meter.syncs_in_a_row == 1 and meter.sync_costs == [1.0, 2.0]
    meter.started_async(0.1)
    assert meter.syncs_in_a_row == 0
    meter.started_async(0.1)  # a new save closes the open one
    assert len(meter.async_costs) == 1


class BackgroundGated(GatedStorage):
    """Data writes from a background thread wait for the gate; the training thread's never do."""

    def write(self, path: str, data: bytes, *, atomic: bool = False) -> None:
        if threading.current_thread() is threading.main_thread():
            super(GatedStorage, self).write(path, data, atomic=atomic)
        else:
            super().write(path, data, atomic=atomic)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _auto(folder: Path, storage: BackgroundGated, clock: Clock, log: ListLog) -> CheckpointManager:
    config = CheckpointConfig(folder=str(folder), interval=3, async_mode=AsyncMode.AUTO)
    return CheckpointManager(config, {"box": Box(1.0)}, storage=storage, logger=StructuredLogger(log), clock=clock)


def _modes(log: ListLog) -> list[tuple[int, str]]:
    return [(r["step"], r["mode"]) for r in log.records if r["message"] == "checkpoint saved"]


def _run(manager: CheckpointManager, clock: Clock, storage: BackgroundGated, steps: range,
         free: float, in_flight: float) -> None:
    """Steps of ``free`` seconds, or ``in_flight`` when a background save ran during them; each
    background write finishes (in no time on the clock) before the next step is timed."""
    for step in steps:
        busy = manager.in_flight
        if busy:
            storage.gate.set()
            manager._thread.join(10)  # noqa: SLF001 - finished, but not yet seen by the manager
            storage.gate.clear()
        clock.now += in_flight if busy else free
        manager.save(step)


def test_auto_moves_to_the_training_thread_when_background_saves_cost_more(tmp_path: Path) -> None:
    storage, clock, log = BackgroundGated(), Clock(), ListLog()
    with _auto(tmp_path, storage, clock, log) as manager:
        _run(manager, clock, storage, range(1, 3 * (REMEASURE_AFTER + 3)), free=1.0, in_flight=3.0)
        storage.gate.set()
    modes = _modes(log)
    # the first save goes to the background; the step beside it took 2 s more than a free step,
    # and the write itself took no time: synchronous from then on, until it is measured again
    assert modes[0] == (3, "async") and all(mode == "sync" for _, mode in modes[1:REMEASURE_AFTER + 1])
    assert modes[REMEASURE_AFTER + 1][1] == "async"
    assert manager.costs.async_costs[0] == pytest.approx(2.0) and manager.costs.sync_costs[0] < 0.5


def test_auto_stays_in_the_background_while_training_keeps_its_speed(tmp_path: Path) -> None:
    storage, clock, log = BackgroundGated(), Clock(), ListLog()
    with _auto(tmp_path, storage, clock, log) as manager:
        _run(manager, clock, storage, range(1, 31), free=1.0, in_flight=1.0)
        storage.gate.set()
    assert {mode for _, mode in _modes(log)} == {"async"} and len(_modes(log)) == 10
    assert manager.costs.async_costs and max(manager.costs.async_costs) == pytest.approx(0.0)


def test_auto_forced_saves_stay_synchronous(tmp_path: Path) -> None:
    storage, clock, log = BackgroundGated(), Clock(), ListLog()
    with _auto(tmp_path, storage, clock, log) as manager:
        assert manager.save(1, force=True) and not manager.in_flight
        assert manager.costs.syncs_in_a_row == 0 and len(manager.costs.sync_costs) == 1
    assert _modes(log) == [(1, "sync")]

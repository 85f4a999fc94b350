"""Unit tests: data validation (exit 65 cases), resumable batch order, RNG round trip, digests."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_resilience_trainer.data import EpochSampler, load_dataset
from gpu_resilience_worker.errors import DataError
from gpu_resilience_worker.state import TrainState, capture_rng, restore_rng, state_digest


def _arrays(n: int = 8) -> dict:
    return {
        "x_train": np.ones((n, 4), np.float32), "y_train": np.arange(n, dtype=np.int64) % 3,
        "x_test": np.ones((2, 4), np.float32), "y_test": np.array([0, 1], np.int64),
    }


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: a.pop("y_test"), "missing arrays"),
        (lambda a: a.update(x_train=np.ones((8,), np.float32)), "shape"),
        (lambda a: a.update(y_train=np.zeros(5, np.int64)), "y_train"),
        (lambda a: a.update(x_test=np.ones((2, 5), np.float32)), "features"),
        (lambda a: a.update(y_train=np.full(8, 0.5)), "integers"),
        (lambda a: a.update(y_test=np.array([-1, 0], np.int64)), "negative"),
        (lambda a: a.update(x_train=np.full((8, 4), np.nan, np.float32)), "NaN"),
        (lambda a: a.update(x_train=np.ones((0, 4), np.float32), y_train=np.zeros(0, np.int64)), "shape"),
    ],
)
def test_invalid_arrays_raise_data_error(tmp_path: Path, change, match: str) -> None:
    arrays = _arrays()
    change(arrays)
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError, match=match):
        load_dataset(str(path))


@pytest.mark.parametrize("content", [None, b"", b"not a zip file", b"PK\x03\x04garbage"])
def test_unreadable_file_raises_data_error(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "d.npz"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError):
        load_dataset(str(path))


def test_object_arrays_are_refused(tmp_path: Path) -> None:
    arrays = _arrays()
    arrays["x_train"] = np.array([object()] * 8)
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError):
        load_dataset(str(path))


def test_sampler_resumes_the_same_order_and_covers_each_epoch() -> None:
    reference = EpochSampler(10, 4, seed=3)
    batches = [reference.next_indices().tolist() for _ in range(9)]
    assert sorted(sum(batches[:3], [])) == list(range(10))  # epoch 0: 4 + 4 + 2
    assert batches[0] != batches[3]  # epoch 1 is another permutation
    for cut in range(1, 9):
        first = EpochSampler(10, 4, seed=3)
        for _ in range(cut):
            first.next_indices()
        resumed = EpochSampler(10, 4, seed=3)
        resumed.load_state_dict(first.state_dict())
        assert [resumed.next_indices().tolist() for _ in range(9 - cut)] == batches[cut:]


def test_rng_states_round_trip_through_primitives() -> None:
    state = capture_rng()
    expected = (random.random(), torch.rand(3))
    random.random(), torch.rand(5)
    restore_rng(state)
    assert random.random() == expected[0]
    assert torch.equal(torch.rand(3), expected[1])


def test_train_state_refuses_a_checkpoint_with_other_settings() -> None:
    from gpu_resilience_worker.errors import ConfigError

    saved = TrainState({"seed": 0, "steps": 10}).state_dict()
    with pytest.raises(ConfigError, match="seed"):
        TrainState({"seed": 1, "steps": 10}).load_state_dict(saved)


def test_state_digest_is_order_independent_and_bit_sensitive() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    b = {"b": torch.tensor([3.0]), "w": torch.tensor([1.0, 2.0])}
    assert state_digest(a) == state_digest(b)
    c = {"b": torch.tensor([3.0]), "w": torch.tensor([1.0, 2.0 + 2e-7])}
    assert state_digest(a) != state_digest(c)
    assert state_digest({"w": torch.tensor([1.0, 2.0])}) != state_digest({"w": torch.tensor([1.0, 2.0], dtype=torch.float64)})


def _attempt(number, execution="job-a", task_index=0, **fields):
    return {"execution": execution, "attempt": number, "task_index": task_index, **fields}


def _gap(number, execution="job-a", task_index=0):
    return _attempt(number, execution, task_index, resumed_from_step=None, lost_steps=0, unrecorded=True)


@pytest.mark.parametrize(
    "recorded, entry, expected",
    [
        ([], _attempt(0), [_attempt(0)]),
        ([_attempt(0), _attempt(1)], _attempt(2), [_attempt(0), _attempt(1), _attempt(2)]),
        # attempt 2 was killed between its "resuming" log line and its record
        ([_attempt(0), _attempt(1)], _attempt(3), [_attempt(0), _attempt(1), _gap(2), _attempt(3)]),
        ([], _attempt(2), [_gap(0), _gap(1), _attempt(2)]),  # a torn or missing file: none recorded
        # another execution's or task's attempts do not count, and are kept as they are
        ([_attempt(0, "job-old"), _attempt(1, "job-old")], _attempt(1), [_attempt(0, "job-old"), _attempt(1, "job-old"),
                                                                         _gap(0), _attempt(1)]),
        ([_attempt(0, task_index=1)], _attempt(1), [_attempt(0, task_index=1), _gap(0), _attempt(1)]),
        # no attempt number (a run outside Cloud Run that sets none): nothing to fill
        ([_attempt(0)], _attempt(None), [_attempt(0), _attempt(None)]),
        ([_attempt(0)], _attempt(True), [_attempt(0), _attempt(True)]),
    ],
)
def test_attempts_that_never_recorded_themselves_are_listed_by_the_next(recorded, entry, expected) -> None:
    from gpu_resilience_worker.files import with_unrecorded_attempts

    assert with_unrecorded_attempts(recorded, entry) == expected


def test_record_attempt_fills_the_gap_in_the_file(tmp_path: Path) -> None:
    from gpu_resilience_worker.files import ATTEMPTS, read_json, record_attempt
    from gpu_resilience_worker.storage import LocalStorage

    storage = LocalStorage()
    record_attempt(storage, str(tmp_path), _attempt(0, lost_steps=0))
    got = record_attempt(storage, str(tmp_path), _attempt(2, lost_steps=3))
    assert got == read_json(storage, str(tmp_path / ATTEMPTS))["attempts"]
    assert [(a["attempt"], a.get("unrecorded", False)) for a in got] == [(0, False), (1, True), (2, False)]
    (tmp_path / ATTEMPTS).write_text('{"attempts": "not a list"}')
    assert [a["attempt"] for a in record_attempt(storage, str(tmp_path), _attempt(1))] == [0, 1]

"""Unit tests: time and Young/Daly intervals, strategy flags, the sweep, snapshot buffers and
overlapped hashing."""

from __future__ import annotations

import hashlib
import io
import math
from pathlib import Path

import pytest
import torch

from gpu_resilience_trainer.config import SWEEP, config_from_args, parse_interval
from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager
from gpu_resilience_worker.policies import SavePolicy
from gpu_resilience_worker.errors import ConfigError
from gpu_resilience_worker.fastio import (
    HashingWriter, chunk_digests, file_chunk_digests, root_digest, start_writeback, stream_chunk_digests,
)
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.snapshot import SnapshotBuffers

from tests.worker.test_checkpoint_unit import Box, ListLog


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_time_and_young_daly_policies() -> None:
    assert not SavePolicy(seconds=30).should_save(5, elapsed=29.9)
    assert SavePolicy(seconds=30).should_save(5, elapsed=30.0)
    policy = SavePolicy(mtbi=3600)
    assert policy.interval(0.5) == pytest.approx(math.sqrt(2 * 0.5 * 3600))  # 60 s
    assert not policy.should_save(1, elapsed=59.0, cost=0.5) and policy.should_save(1, elapsed=60.0, cost=0.5)
    assert SavePolicy(mtbi=1, floor=5.0).interval(0.01) == 5.0


def test_auto_interval_is_logged_and_follows_the_measured_cost(tmp_path: Path) -> None:
    clock, log = FakeClock(), ListLog()
    config = CheckpointConfig(folder=str(tmp_path), interval=0, auto_interval=True, mtbi_seconds=200,
                              async_mode=AsyncMode.DISABLED)
    with CheckpointManager(config, {"box": Box()}, logger=StructuredLogger(log), clock=clock) as manager:
        chosen = [r for r in log.records if r["message"].startswith("checkpoint interval:")]
        assert chosen[0]["interval_seconds"] == pytest.approx(20.0) and chosen[0]["measured"] is False
        clock.now += 19.0
        assert manager.save(1) is False
        clock.now += 1.0
        assert manager.save(2) is True  # 20 s after the start, with the assumed 1 s cost
        assert manager.auto_interval_seconds() == pytest.approx(0.0)  # measured cost: 0 s (fake clock)
    chosen = [r for r in log.records if r["message"].startswith("checkpoint interval:")]
    assert chosen[-1]["measured"] is True


@pytest.mark.parametrize(
    ("spec", "every", "expected"),
    [
        (None, 50, {"interval": 50, "interval_seconds": 0.0, "auto_interval": False}),
        (None, 0, {"interval": 0, "interval_seconds": 0.0, "auto_interval": False}),
        ("25", 50, {"interval": 25, "interval_seconds": 0.0, "auto_interval": False}),
        ("30s", 50, {"interval": 0, "interval_seconds": 30.0, "auto_interval": False}),
        ("auto", 50, {"interval": 0, "interval_seconds": 0.0, "auto_interval": True}),
    ],
)
def test_parse_interval(spec, every: int, expected: dict) -> None:
    assert parse_interval(spec, every) == expected


@pytest.mark.parametrize("spec", ["soon", "-5s", "0s", "1.5"])
def test_parse_interval_refuses_nonsense(spec: str) -> None:
    with pytest.raises(ConfigError, match="checkpoint-interval"):
        parse_interval(spec, 50)


def test_strategy_flags() -> None:
    """The goodput benchmark's three strategies through the same worker."""
    none = config_from_args(["train", "--checkpoint-every", "0"], {})
    assert not none.checkpoint.enabled
    common = config_from_args(["train", "--checkpoint-every", "5", "--sync-save", "--preemption-save", "always"], {})
    assert common.checkpoint.interval == 5 and common.checkpoint.async_mode is AsyncMode.DISABLED
    assert common.preemption_save == "always"
    ours = config_from_args(["train", "--checkpoint-interval", "auto", "--mtbi", "600"], {})
    assert ours.checkpoint.auto_interval and ours.checkpoint.mtbi_seconds == 600
    assert ours.checkpoint.async_mode is AsyncMode.ASYNC and ours.preemption_save == "deadline"
    with pytest.raises(ConfigError):
        config_from_args(["train", "--sync-save", "--async-save"], {})


def test_multi_task_executions_train_the_sweep_members() -> None:
    env = {"CLOUD_RUN_TASK_COUNT": "6"}
    members = [config_from_args(["train"], {**env, "CLOUD_RUN_TASK_INDEX": str(i)}) for i in range(6)]
    assert [m.sweep_member for m in members] == [0, 1, 2, 3, 0, 1]
    assert [(m.train.lr, m.train.hidden) for m in members[:4]] == [(s["lr"], s["hidden"]) for s in SWEEP]
    assert len({m.namespace for m in members}) == 6  # each task in its own namespace
    single = config_from_args(["train", "--lr", "0.01"], {})
    assert single.sweep_member is None and single.train.lr == 0.01
    off = config_from_args(["train", "--sweep", "off", "--lr", "0.01"], {**env, "CLOUD_RUN_TASK_INDEX": "3"})
    assert off.sweep_member is None and off.train.lr == 0.01


def test_snapshot_buffers_are_reused_and_hold_the_values_at_copy_time() -> None:
    buffers = SnapshotBuffers()
    state = {"w": torch.arange(6.0).reshape(2, 3).t(), "meta": [1, "x"], "step": torch.tensor(3)}
    first = buffers.copy(state)
    assert torch.equal(first["w"], state["w"]) and first["meta"] == [1, "x"]
    pointer = first["w"].data_ptr()
    state["w"].add_(1)  # the source changes, the snapshot does not
    assert first["w"][0, 0].item() == 0.0
    second = buffers.copy(state)
    assert second["w"].data_ptr() == pointer and second["w"][0, 0].item() == 1.0
    assert buffers.nbytes == 6 * 4 + 8


def _adopt_cases() -> list[tuple[str, dict, dict, list[str]]]:
    """(case, loaded, live, names adopted): what a restore's host tensors may become."""
    kept = torch.ones(4)
    tied = torch.arange(4.0)
    return [
        ("copied into the live tensor: adopted", {"w": torch.ones(4)}, {"w": torch.zeros(4)}, ["w"]),
        ("kept by the live state (an optimizer's moment): not adopted", {"m": kept}, {"m": kept}, []),
        ("a view of a kept storage: not adopted", {"m": kept[:2]}, {"m": kept[2:]}, []),
        ("another dtype: not adopted", {"w": torch.ones(4)}, {"w": torch.zeros(4, dtype=torch.float64)}, []),
        ("another shape: not adopted", {"w": torch.ones(4)}, {"w": torch.zeros(2, 2)}, []),
        ("two loaded tensors on one storage: the first only", {"a": tied, "b": tied},
         {"a": torch.zeros(4), "b": torch.zeros(4)}, ["a"]),
        ("nested in lists and dicts", {"s": {0: [torch.ones(2)]}}, {"s": {0: [torch.zeros(2)]}}, ["s/0/0"]),
        ("not in the live state: ignored", {"extra": torch.ones(2)}, {}, []),
    ]


@pytest.mark.parametrize(("case", "loaded", "live", "adopted"), _adopt_cases(), ids=[c[0] for c in _adopt_cases()])
def test_snapshot_buffers_adopt_restored_tensors_the_states_did_not_keep(case: str, loaded: dict, live: dict,
                                                                         adopted: list[str]) -> None:
    buffers = SnapshotBuffers()
    nbytes = buffers.adopt(loaded, live)
    assert ["/".join(map(str, key)) for key in buffers._buffers] == adopted, case
    assert nbytes == buffers.nbytes
    snapshot = buffers.copy(live)  # a snapshot into adopted buffers holds the live values, apart from them
    for key in buffers._buffers:
        value, source = snapshot, live
        for part in key:
            value, source = value[part], source[part]
        assert torch.equal(value, source) and value.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()


def _expected_chunks(data: bytes, chunk_bytes: int) -> list[str]:
    return [hashlib.sha256(data[o : o + chunk_bytes]).hexdigest() for o in range(0, len(data), chunk_bytes)]


@pytest.mark.parametrize(
    ("sizes", "chunk_bytes"),
    [
        ([10, 3, 0], 1 << 20),  # small writes only: buffered, one chunk
        ([3 << 20, 5, 9 << 20, 7], 4 << 20),  # big writes crossing chunk boundaries mid-write
        ([40 << 20], 8 << 20),  # one write spanning exactly five chunks
        ([1 << 20, 1 << 20], 1 << 20),  # writes ending on chunk boundaries
        ([5, (2 << 20) - 5, 1], 1 << 20),  # a small write, then a big one finishing its chunk
    ],
)
def test_hashing_writer_and_readers_agree_with_hashlib(tmp_path: Path, sizes: list[int], chunk_bytes: int) -> None:
    parts = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    data = b"".join(parts)
    path = tmp_path / "f.bin"
    with open(path, "wb", buffering=0) as handle:
        writer = HashingWriter(handle, chunk_bytes)
        for part in parts:
            assert writer.write(part) == len(part)
        chunks = writer.digests()
        assert writer.size == len(data)
    assert path.read_bytes() == data
    assert chunks == _expected_chunks(data, chunk_bytes) == chunk_digests(data, chunk_bytes)
    assert file_chunk_digests(str(path), chunk_bytes) == (len(data), chunks)
    with open(path, "rb", buffering=0) as handle:
        assert stream_chunk_digests(handle, chunk_bytes) == (len(data), chunks)


def test_empty_files_hash_to_empty_lists(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    assert file_chunk_digests(str(tmp_path / "empty")) == (0, [])
    assert stream_chunk_digests(io.BytesIO(b"")) == (0, [])
    assert root_digest([]) == hashlib.sha256(b"").hexdigest()


def test_start_writeback_is_a_harmless_hint(tmp_path: Path) -> None:
    with open(tmp_path / "f.bin", "wb", buffering=0) as handle:
        handle.write(b"x" * 4096)
        start_writeback(handle.fileno(), 0, 4096)
        start_writeback(handle.fileno(), 0, 0)
    assert (tmp_path / "f.bin").read_bytes() == b"x" * 4096


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_snapshots_into_pinned_buffers_and_round_trips(tmp_path: Path) -> None:
    from gpu_resilience_worker.state import capture_rng

    box = Box()
    box.tensor = torch.randn(1 << 20, device="cuda")
    snapshot = SnapshotBuffers().copy({"t": box.tensor})
    assert snapshot["t"].is_pinned() and torch.equal(snapshot["t"].cuda(), box.tensor)
    assert len(capture_rng()["cuda"]) == torch.cuda.device_count()
    config = CheckpointConfig(folder=str(tmp_path), interval=1)
    with CheckpointManager(config, {"box": box}, logger=StructuredLogger(ListLog())) as manager:
        assert manager.save(1)
    restored = Box()
    with CheckpointManager(config, {"box": restored}, logger=StructuredLogger(ListLog())) as manager:
        assert manager.load()
    assert torch.equal(restored.tensor, box.tensor.cpu())

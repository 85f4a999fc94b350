"""Fixtures for the worker tests: a digits .npz, and real worker processes with real signals."""

from __future__ import annotations

import dataclasses
import hashlib
import zlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Training flags shared by every run whose final hashes are compared with the baseline. No
#: ``--threads``: bit-exactness is asserted at torch's default intra-op thread count.
TRAIN_FLAGS = ("--steps", "200", "--batch-size", "64", "--seed", "0")


def write_digits(path: Path) -> None:
    """Write the digits .npz the DAG's setup step writes (stratified 80/20 split, seed 0)."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)


@pytest.fixture(scope="session")
def digits_npz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:return: path of a digits .npz shared by all tests."""
    path = tmp_path_factory.mktemp("data") / "digits.npz"
    write_digits(path)
    return path


def worker_env(**extra: str) -> dict[str, str]:
    """:return: an environment for a worker process (no CLOUD_RUN_* / CHECKPOINT_* leaking in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLOUD_RUN_", "CHECKPOINT_", "WORKER_TEST_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "worker"), str(REPO_ROOT)])
    env.update(extra)
    return env


#: The worker on :class:`tests.worker.pausing.PausingStorage`, for ``WORKER_TEST_PAUSE_*``.
PAUSING_WORKER = "tests.worker.pausing"


class WorkerProcess:
    """A ``python -m gpu_resilience_trainer train`` child whose JSON log lines are collected as they arrive.

    With a ``WORKER_TEST_PAUSE_*`` variable in ``env``, the child is ``python -m``
    :data:`PAUSING_WORKER` instead: the same worker, on storage that pauses inside saves.
    """

    def __init__(self, args: list[str], env: dict[str, str], *, new_group: bool = False) -> None:
        module = PAUSING_WORKER if any(k.startswith("WORKER_TEST_PAUSE_") for k in env) else "gpu_resilience_trainer"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=new_group,
        )
        self.records: list[dict] = []
        self.raw: list[str] = []
        self._queue: queue.Queue[dict | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.raw.append(line)
            try:
                record = json.loads(line)
            except ValueError:
                continue
            self.records.append(record)
            self._queue.put(record)
        self._queue.put(None)

    def wait_for(self, predicate, timeout: float = 30.0, allow_exit: bool = False) -> dict | None:
        """Block until a log record satisfies ``predicate``; fail on timeout.

        :param allow_exit: return ``None`` when the worker exits first, instead of failing.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                record = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"timed out waiting for a log record; output:\n{self.output}")
            if record is None:
                if allow_exit:
                    return None
                pytest.fail(f"worker exited before the awaited log record; output:\n{self.output}")
            if predicate(record):
                return record

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the child."""
        self.proc.send_signal(signum)

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the child's whole process group (started with ``new_group``)."""
        os.killpg(self.proc.pid, signum)

    def wait(self, timeout: float = 300.0) -> int:
        """:return: the exit code (negative for a signal), after the log reader drained."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return code

    @property
    def output(self) -> str:
        return "".join(self.raw)

    def messages(self, severity: str | None = None) -> list[dict]:
        return [r for r in self.records if severity is None or r.get("severity") == severity]


@dataclasses.dataclass
class Task:
    """One task namespace under a temporary checkpoint root, and how to start attempts in it."""

    root: Path
    data: Path
    job: str = "job"
    attempt: int = 0

    @property
    def namespace(self) -> Path:
        return self.root / self.job / "task-0"

    def start(self, *extra: str, env: dict[str, str] | None = None, flags=TRAIN_FLAGS,
              new_group: bool = False) -> WorkerProcess:
        """Start the next attempt (``CLOUD_RUN_TASK_ATTEMPT`` increments like a Cloud Run retry)."""
        identity = {
            "CLOUD_RUN_JOB": self.job, "CLOUD_RUN_EXECUTION": f"{self.job}-exec",
            "CLOUD_RUN_TASK_INDEX": "0", "CLOUD_RUN_TASK_COUNT": "1",
            "CLOUD_RUN_TASK_ATTEMPT": str(self.attempt),
        }
        environment = worker_env(**{**identity, **(env or {})})
        self.attempt += 1
        args = ["train", "--checkpoint-dir", str(self.root), "--data", str(self.data), *flags, *extra]
        return WorkerProcess(args, environment, new_group=new_group)

    def run(self, *extra: str, env: dict[str, str] | None = None, timeout: float = 300.0) -> WorkerProcess:
        """Run one attempt to its end."""
        process = self.start(*extra, env=env)
        process.wait(timeout=timeout)
        return process

    def metrics(self) -> dict:
        return json.loads((self.namespace / "metrics.json").read_text())

    def valid_steps(self) -> list[int]:
        """Steps whose commit record matches the data file (checked independently of the worker)."""
        steps = []
        for record_path in sorted(self.namespace.glob("ckpt-*.commit.json")):
            try:
                record = json.loads(record_path.read_text())
                data = (self.namespace / record_path.name.replace(".commit.json", ".pt")).read_bytes()
            except (OSError, ValueError):
                continue
            if len(data) == record["size"] and _digest_of(data, record) == record["sha256"]:
                steps.append(record["step"])
        return sorted(steps)


def _digest_of(data: bytes, record: dict) -> str:
    """The record's kind of sha256 of ``data``, recomputed here: of the whole file, or (with a
    hash list) of the concatenated sha256 digests of every ``chunk_bytes`` bytes."""
    size = record.get("chunk_bytes")
    if not size:
        return hashlib.sha256(data).hexdigest()
    digests = [_chunk_digest(data[o : o + size], record.get("digest", "sha256")) for o in range(0, len(data), size)]
    if [d.hex() for d in digests] != record["chunks"]:
        return ""
    return hashlib.sha256(b"".join(digests)).hexdigest()


def _chunk_digest(chunk: bytes, kind: str) -> bytes:
    """One chunk's digest, recomputed independently of the worker: sha256 (records without a
    ``digest`` field), CRC-32 (zlib) or CRC-32C (google-crc32c), big-endian."""
    if kind == "sha256":
        return hashlib.sha256(chunk).digest()
    if kind == "crc32":
        return zlib.crc32(chunk).to_bytes(4, "big")
    assert kind == "crc32c", kind
    import google_crc32c

    return google_crc32c.value(chunk).to_bytes(4, "big")


@pytest.fixture
def task(tmp_path: Path, digits_npz: Path) -> Task:
    """:return: a fresh task namespace."""
    return Task(root=tmp_path / "checkpoints", data=digits_npz)


@pytest.fixture(scope="session")
def baseline(tmp_path_factory: pytest.TempPathFactory, digits_npz: Path) -> tuple[Task, WorkerProcess]:
    """An uninterrupted run with :data:`TRAIN_FLAGS`; its hashes are the reference."""
    run_task = Task(root=tmp_path_factory.mktemp("baseline"), data=digits_npz)
    process = run_task.run("--checkpoint-every", "20", "--keep", "3")
    assert process.proc.returncode == 0, process.output
    return run_task, process


SIGTERM, SIGKILL = signal.SIGTERM, signal.SIGKILL


@pytest.fixture
def placements(monkeypatch) -> list[dict]:
    """The storages each kept restore placed (recorded when the placement is kept)."""
    from gpu_resilience_worker.restore_copy import LocalCopy

    kept: list[dict] = []
    original = LocalCopy.keep_placed

    def keep_placed(self: LocalCopy) -> None:
        kept.append(dict(self.placed))
        original(self)

    monkeypatch.setattr(LocalCopy, "keep_placed", keep_placed)
    return kept


@pytest.fixture
def put_back(monkeypatch) -> list[int]:
    """The bytes each closed copy gave back to the modules (placed, then not kept); -1 for a swap back."""
    from gpu_resilience_worker.restore_copy import LocalCopy

    given: list[int] = []
    original = LocalCopy._give_back

    def spy(self: LocalCopy, swap: bool = False) -> None:
        given.append(-1 if swap else self.displaced_bytes)
        original(self, swap)

    monkeypatch.setattr(LocalCopy, "_give_back", spy)
    return given

"""ResilientLoop, the plain-loop helper, with real processes and real signals.

The process is the user-image example's own script (``examples/user-image/train.py``): a plain
PyTorch loop (MLP with dropout, batches drawn from torch's global RNG) on the library. An
uninterrupted run is the reference; a run stopped by SIGTERM, resumed, killed by SIGKILL, with
its newest checkpoint then corrupted, and resumed again, ends with the same model bits.
Cost: about 25 s on 2 busy cores (six short processes, each importing torch).
"""

from __future__ import annotations

import io
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.worker.conftest import REPO_ROOT, WorkerProcess, worker_env

# serial (scripts/run_tests.sh runs it alone): real worker processes against grace periods and task deadlines (exit before the deadline, within the grace).
pytestmark = pytest.mark.serial

SCRIPT = REPO_ROOT / "examples" / "user-image" / "train.py"
#: 60 steps, a checkpoint every 10, 20 ms per step: about 1.5 s of training per full run.
FLAGS = ["train", "--steps=60", "--checkpoint-every=10", "--step-delay=0.02", "--seed=3"]
GRACE = 5.0


class ScriptProcess(WorkerProcess):
    """The example script as a child process; its JSON log lines are collected as they arrive."""

    def __init__(self, root: Path, *args: str, env: dict[str, str] | None = None, attempt: int = 0) -> None:
        environment = worker_env(CHECKPOINT_DIR=str(root), CLOUD_RUN_JOB="own-loop", CLOUD_RUN_EXECUTION="own-loop-1",
                                 CLOUD_RUN_TASK_ATTEMPT=str(attempt), PREEMPTION_GRACE_SECONDS=str(GRACE),
                                 **(env or {}))
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=root.parent, env=environment,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.records, self.raw = [], []
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()


def _saved(at_least: int):
    return lambda r: r.get("message") == "checkpoint saved" and r.get("step", -1) >= at_least


def _metrics(root: Path) -> dict:
    return json.loads((root / "own-loop" / "task-0" / "metrics.json").read_text())


def test_import_loads_neither_torch_nor_the_trainer_nor_airflow() -> None:
    """``import gpu_resilience_worker`` is light; the helper's import brings torch but not the
    bundled digits trainer, its data module, Airflow or a Google client."""
    code = (
        "import sys, gpu_resilience_worker as g\n"
        "assert 'torch' not in sys.modules, 'torch imported by the package'\n"
        "from gpu_resilience_worker import ResilientLoop, CheckpointManager, PreemptionWatcher, write_fatal\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'airflow' or m.startswith('google.cloud.')\n"
        "       or m.split('.')[0] == 'gpu_resilience_trainer']\n"
        "assert not bad, bad\n"
        "assert sorted(g.__all__) == sorted(g._MODULE_OF) and all(getattr(g, n) is not None for n in g.__all__)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_sigterm_exits_143_within_grace_and_resumes_bit_identical_after_sigkill_and_a_torn_checkpoint(
        tmp_path: Path) -> None:
    reference = ScriptProcess(tmp_path / "reference", *FLAGS)
    assert reference.wait(timeout=120) == 0, reference.output
    expected = _metrics(tmp_path / "reference")["model_sha256"]

    root = tmp_path / "interrupted"
    first = ScriptProcess(root, *FLAGS, attempt=0)
    first.wait_for(_saved(20), timeout=60)
    sent = time.monotonic()
    first.signal(signal.SIGTERM)
    assert first.wait(timeout=GRACE + 5) == 143, first.output
    assert time.monotonic() - sent < GRACE, "the exit came after the grace period"
    [stop] = [r for r in first.records if r.get("message") == "exiting: interrupted, resumable"]
    assert stop["last_checkpoint_step"] == stop["step"] > 20  # the flush at the stop committed
    progress = json.loads((root / "own-loop" / "task-0" / "progress.json").read_text())
    assert progress["status"] == "preempted" and progress["step"] == stop["step"]

    second = ScriptProcess(root, *FLAGS, attempt=1)
    resumed = second.wait_for(lambda r: r.get("message", "").startswith("resuming from step"), timeout=60)
    assert resumed["resumed_from_step"] == stop["step"]
    second.wait_for(_saved(min(stop["step"] + 10, 50)), timeout=60)
    second.signal(signal.SIGKILL)
    assert second.wait(timeout=10) == -signal.SIGKILL

    namespace = root / "own-loop" / "task-0"
    committed = sorted(int(p.name[5:13]) for p in namespace.glob("ckpt-*.commit.json"))
    newest = namespace / f"ckpt-{committed[-1]:08d}.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a torn/corrupt newest checkpoint: it must be skipped
    newest.write_bytes(bytes(data))

    third = ScriptProcess(root, *FLAGS, attempt=2)
    assert third.wait(timeout=120) == 0, third.output
    skipped = [r for r in third.records if r.get("message") == "skipping invalid checkpoint"]
    assert skipped and skipped[0]["step"] == committed[-1]
    [resumed] = [r for r in third.records if r.get("message", "").startswith("resuming from step")]
    assert resumed["resumed_from_step"] == committed[-2]
    metrics = _metrics(root)
    assert metrics["model_sha256"] == expected
    assert [a["resumed_from_step"] for a in metrics["attempts"]] == [0, stop["step"], committed[-2]]


def test_task_deadline_stops_with_a_checkpoint_before_the_timeout(tmp_path: Path) -> None:
    """``TASK_TIMEOUT_SECONDS=30``: the loop stops ``min(grace, 30/2)`` = 10 s before it (counted
    from the process's start, torch's import included), saves (the measured saves say it fits in
    those 10 s), and exits 143 before the timeout. (20 s to the stop leave room for torch's import
    on a busy machine: with 16 s, a start-up of over 11 s at a load of 10 met the deadline before
    the first step, which is the start-up test's case, not this one.)"""
    root = tmp_path / "deadline"
    started = time.monotonic()
    process = ScriptProcess(root, "train", "--steps=1000000", "--checkpoint-every=20", "--step-delay=0.02",
                            env={"TASK_TIMEOUT_SECONDS": "30"})
    assert process.wait(timeout=90) == 143, process.output
    [notice] = [r for r in process.records if r.get("message", "").startswith("DEADLINE received")]
    [stop] = [r for r in process.records if r.get("message") == "exiting: interrupted, resumable"]
    assert stop["last_checkpoint_step"] == stop["step"] == notice["step"] > 0
    assert time.monotonic() - started < 30  # before the timeout, which counts from the process start


def _loop(folder: Path, **options):
    import torch

    from gpu_resilience_worker import ResilientLoop, StructuredLogger

    model = torch.nn.Linear(2, 1)
    return ResilientLoop({"model": model}, folder=str(folder), logger=StructuredLogger(io.StringIO()),
                         argv=["test"], env={}, **{"total_steps": 5, "checkpoint_every": 2, **options})


def test_a_worker_error_writes_fatal_and_the_same_invocation_then_exits_at_once(tmp_path: Path) -> None:
    from gpu_resilience_worker import ConfigError

    calls = []

    def bad_step(step: int) -> float:
        calls.append(step)
        if step == 3:
            raise ConfigError("the learning rate is not a learning rate")
        return 1.0

    assert _loop(tmp_path).run(bad_step) == 78
    fatal = json.loads((tmp_path / "FATAL").read_text())
    assert fatal["exit_code"] == 78 and "learning rate" in fatal["reason"]
    assert _loop(tmp_path).run(bad_step) == 78 and calls == [0, 1, 2, 3]  # no step the second time


def test_a_step_that_raises_after_the_stop_request_is_answered_as_the_stop(tmp_path: Path) -> None:
    """Cloud Run signals the whole process group: a DataLoader worker still starting (before its
    ``worker_init_fn``) dies of the SIGTERM, and the main process's next batch raises. After a stop
    request such an error is the stop (exit 143, the last checkpoint kept, the torn step not
    saved); before one it is still a failure (exit 1)."""
    import os

    def step_fn(step: int) -> float:
        model.weight.data.add_(1.0)  # a part of the step already applied
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler has run: the stop is requested
            raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated.")
        return 1.0

    loop = _loop(tmp_path / "stopped", checkpoint_every=2, preemption_save="always")
    model = loop.states["model"]
    assert loop.run(step_fn) == 143
    steps = sorted(p.name for p in (tmp_path / "stopped").glob("ckpt-*.commit.json"))
    assert steps == ["ckpt-00000002.commit.json"]  # not step 3, although the policy is "always"
    progress = json.loads((tmp_path / "stopped" / "progress.json").read_text())
    assert progress["status"] == "preempted"

    def failing(step: int) -> float:
        if step == 3:
            raise RuntimeError("a real error")
        return 1.0

    assert _loop(tmp_path / "failed").run(failing) == 1


def test_a_nan_loss_is_divergence_and_other_settings_refuse_the_checkpoint(tmp_path: Path) -> None:
    assert _loop(tmp_path / "nan").run(lambda step: float("nan") if step == 1 else 0.5) == 70
    assert _loop(tmp_path / "a", settings={"lr": 0.1}).run(lambda step: 0.5) == 0
    assert _loop(tmp_path / "a", settings={"lr": 0.2}).run(lambda step: 0.5) == 78
    assert "other settings" in json.loads((tmp_path / "a" / "FATAL").read_text())["reason"]


@pytest.mark.parametrize(("options", "name"), [
    ({"total_steps": 0}, "total_steps"), ({"checkpoint_every": -1}, "checkpoint_every"),
    ({"keep_latest_k": 1}, "keep_latest_k"), ({"preemption_save": "sometimes"}, "preemption_save"),
    ({"task_timeout_seconds": 0}, "task_timeout_seconds"), ({"mtbi_seconds": float("inf")}, "mtbi_seconds"),
])
def test_bad_parameters_raise_one_error_naming_them_before_anything_is_written(
        tmp_path: Path, options: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        _loop(tmp_path / "x", **options)
    assert not (tmp_path / "x").exists()


def test_a_state_without_state_dict_or_the_reserved_name_is_refused(tmp_path: Path) -> None:
    from gpu_resilience_worker import ResilientLoop

    with pytest.raises(ValueError, match=r"states\['model'\] has no state_dict"):
        ResilientLoop({"model": object()}, total_steps=3, folder=str(tmp_path))
    with pytest.raises(ValueError, match="train_state"):
        ResilientLoop({"train_state": _loop(tmp_path).state}, total_steps=3, folder=str(tmp_path))


SLOW_START = r'''
import sys, time
import torch
from gpu_resilience_worker import ResilientLoop, exit_now

time.sleep(float(sys.argv[1]))  # the user's start-up: data download, model build, CUDA context
print("start-up done at", time.time(), flush=True)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def step(done):
    time.sleep(0.05)
    optimizer.zero_grad()
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss.item()


loop = ResilientLoop({"model": model, "optimizer": optimizer}, total_steps=100000, checkpoint_every=20,
                     folder=sys.argv[2])
exit_now(loop.run(step))
'''


def test_task_deadline_counts_from_the_process_start_not_from_run(tmp_path: Path) -> None:
    """Cloud Run's task timeout counts from the container's start; a loop built after 8 s of the
    user's own start-up must still stop ``min(grace, timeout/2)`` before it, not that much later
    (the deadline used to count from ``run()``, so at the default settings the stop came after the
    timeout)."""
    script = tmp_path / "slow_start.py"
    script.write_text(SLOW_START)
    started = time.time()
    process = subprocess.Popen([sys.executable, str(script), "8", str(tmp_path / "ckpt")], cwd=tmp_path,
                               env=worker_env(TASK_TIMEOUT_SECONDS="20", PREEMPTION_GRACE_SECONDS="10"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = process.communicate(timeout=120)
    ended = time.time()
    assert process.returncode == 143, output
    assert "DEADLINE received" in output, output
    startup_done = float(re.search(r"start-up done at ([0-9.]+)", output).group(1))
    # The stop is due 10 s after the process started (the 20 s timeout less the 10 s margin). When
    # the user's start-up (torch's import and 8 s of sleep) outlasts that, as on a busy machine, the
    # loop stops before its restore ("during start-up"), which a deadline counted from run() never
    # does; otherwise it stops in training, less than 10 s after the start-up, which a deadline
    # counted from run() (10 s after it at the earliest) cannot.
    if "received during start-up" not in output:
        assert ended - startup_done < 9.5, (f"stopped {ended - started:.1f} s after the process started and "
                                            f"{ended - startup_done:.1f} s after its start-up, timeout 20 s:\n"
                                            f"{output[-3000:]}")


EARLY_WATCHER = r'''
import sys, time
import torch
from gpu_resilience_worker import PreemptionWatcher, ResilientLoop, exit_now

watcher = PreemptionWatcher()
watcher.install()  # as the README says: catch a SIGTERM that comes while the model is built
print("installed", flush=True)
time.sleep(float(sys.argv[2]))  # the user's start-up
torch.manual_seed(0)
model = torch.nn.Linear(512, 512)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def step(done):
    time.sleep(0.05)
    optimizer.zero_grad()
    loss = model(torch.randn(8, 512)).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss.item()


loop = ResilientLoop({"model": model, "optimizer": optimizer}, total_steps=int(sys.argv[3]), checkpoint_every=10,
                     folder=sys.argv[1], watcher=watcher)
exit_now(loop.run(step))
'''


def test_a_sigterm_during_start_up_exits_143_before_the_restore(tmp_path: Path) -> None:
    """With a watcher installed early, a SIGTERM during the user's start-up ends the attempt with
    143 at once, as the bundled worker does: nothing past the last checkpoint exists, so reading
    and loading that checkpoint (minutes for a large model) would only eat the grace period."""
    script = tmp_path / "early.py"
    script.write_text(EARLY_WATCHER)
    folder = tmp_path / "ckpt"
    first = subprocess.Popen([sys.executable, str(script), str(folder), "0", "1000"], env=worker_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert first.stdout.readline().strip() == "installed"
    deadline = time.monotonic() + 120  # training, not start-up: wait for its first checkpoint (a fixed
    while not list(folder.glob("*.commit.json")):  # sleep was not enough on a busy machine)
        assert first.poll() is None and time.monotonic() < deadline, "no checkpoint from the first run"
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)
    output, _ = first.communicate(timeout=120)
    assert first.returncode == 143 and "checkpoint saved" in output, output
    process = subprocess.Popen([sys.executable, str(script), str(folder), "5", "1000"], env=worker_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout.readline().strip() == "installed"
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 143, output
    assert "resuming from step" not in output and "received during start-up" in output, output

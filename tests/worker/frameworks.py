"""Real processes for the framework integration tests: a fork server, pause hooks and checks.

Importing torch with ``transformers`` or ``lightning`` takes 5-15 s of CPU here, more than the
training a test needs. :class:`ForkServer` imports them once and forks one real child process
per attempt: each child is a new process with its own pid that the test signals directly
(SIGTERM, SIGKILL) and whose exit status comes back from ``waitpid``. Children run the job
script with :func:`runpy.run_path`, as ``python script.py`` would, with stdout and stderr in a
log file; ``import tests.worker.frameworks`` first installs the pause hooks of the
``WORKER_TEST_PAUSE_*`` variables.

Bit-exactness is asserted at torch's default thread count (the machine's cores: 2 here), the
count a user's script gets: ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` are removed from the
environment, and every attempt that ends reports its thread count, which must be that default.
The environment carries what the example user image sets (``MKL_CBWR=AUTO,STRICT``: oneMKL's
reproducibility mode, in which matrix products give the same bits for any thread count;
``MKL_DYNAMIC``/``OMP_DYNAMIC`` off: no run-time change of the thread count) and
``OMP_WAIT_POLICY=PASSIVE`` (idle OpenMP threads sleep instead of spinning; it changes no result,
only keeps a test's processes from taking both cores from the ones it runs beside).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The framework examples the documentation includes (``docs/examples/``), by block name.
EXAMPLES = {"transformers-trainer": REPO_ROOT / "docs" / "examples" / "transformers_trainer.py",
            "lightning-fit": REPO_ROOT / "docs" / "examples" / "lightning_fit.py"}
#: Interruptions of each kind (SIGTERM, SIGKILL) per framework; CI runs the default 10.
FAULTS_N = int(os.environ.get("FRAMEWORK_FAULTS_N", "10"))

_SERVER = r"""
import json, os, runpy, sys, time, traceback
for name in sys.argv[1:]:
    try:
        __import__(name.lstrip("?"))
    except ImportError:
        if not name.startswith("?"):  # "?name": imported when installed
            raise
threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
print(json.dumps({"ready": True, "threads": threads}), flush=True)
while True:
    line = sys.stdin.readline()
    if not line:
        break
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
            os.chdir(req["cwd"])
            os.environ.update(req["env"])
            sys.argv = [req["script"]]
            __import__("tests.worker.frameworks")
            runpy.run_path(req["script"], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            if "torch" in sys.modules:
                print(json.dumps({"message": "torch threads", "threads": sys.modules["torch"].get_num_threads()}))
            sys.stdout.flush()
            os._exit(code)
    print(json.dumps({"pid": pid, "started": time.monotonic()}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status), "ended": time.monotonic()}), flush=True)
"""


def readme_block(name: str) -> str:
    """:return: the source of the framework example ``name`` (a key of :data:`EXAMPLES`)."""
    return EXAMPLES[name].read_text()


class ForkServer:
    """A process that imported ``modules`` once and forks one child per :meth:`start`.

    :param modules: modules to import in the server (the framework and the integration);
        ``"?name"`` is imported when installed. The server and its children run at torch's
        default thread count (no ``OMP_NUM_THREADS``).
    """

    def __init__(self, modules: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKER_TEST_", "CLOUD_RUN_"))
               and k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_CBWR", "MKL_DYNAMIC", "OMP_DYNAMIC")}
        env.update(MKL_CBWR="AUTO,STRICT", MKL_DYNAMIC="FALSE", OMP_DYNAMIC="FALSE", OMP_WAIT_POLICY="PASSIVE", HF_HUB_DISABLE_PROGRESS_BARS="1",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "worker"), str(REPO_ROOT)]))
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, *modules], cwd=REPO_ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = json.loads(self.proc.stdout.readline())
        assert ready.get("ready"), "the fork server did not start"
        #: torch's default thread count in the server (and so in every child), or None without torch.
        self.threads: int | None = ready.get("threads")
        self.child: int | None = None
        self._reply: dict[str, Any] | None = None

    def running(self) -> bool:
        """:return: whether the child is still running (without waiting)."""
        import select

        if self._reply is None and select.select([self.proc.stdout], [], [], 0)[0]:
            self._reply = json.loads(self.proc.stdout.readline())
        return self._reply is None

    def start(self, script: Path, cwd: Path, log: Path, **env: str) -> tuple[int, float]:
        """Fork a child running ``script`` in ``cwd``. :return: ``(pid, monotonic start time)``."""
        self.proc.stdin.write(json.dumps({"script": str(script), "cwd": str(cwd), "log": str(log), "env": env}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        self.child = reply["pid"]
        return reply["pid"], reply["started"]

    def wait(self, timeout: float = 120.0) -> tuple[int, float]:
        """:return: ``(exit status, monotonic end time)`` of the child (status -N: killed by signal N)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                reply, self._reply, self.child = self._reply, None, None
                return reply["status"], reply["ended"]
            time.sleep(0.02)
        self.kill_child()
        raise AssertionError(f"the child did not end within {timeout} s")

    def kill_child(self) -> None:
        """SIGKILL the running child, if any."""
        if self.child is not None:
            try:
                os.kill(self.child, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """End the child and the server."""
        self.kill_child()
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def log_records(log: Path) -> list[dict[str, Any]]:
    """:return: the JSON log records of ``log`` (other lines skipped)."""
    records = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"message"' in line:
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


def wait_for(log: Path, message: str, server: ForkServer, timeout: float = 60.0) -> dict[str, Any] | None:
    """:return: the first record with ``message`` once it is in ``log``, or ``None`` after
    ``timeout`` or once the server's child ended without it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.running():
        if log.exists():
            for record in log_records(log):
                if record["message"] == message:
                    return record
        time.sleep(0.01)
    return None


def intact_steps(folder: Path, prefix: str, suffix: str = "") -> tuple[list[int], list[int]]:
    """Check the folder independently of the library: an artifact is intact when its record
    parses and every file it lists has the recorded size and sha256 (one chunk: files < 64 MiB).

    :return: ``(intact steps, other present steps)``, each newest first.
    """
    import re

    pattern = re.compile(rf"^{re.escape(prefix)}(\d+){re.escape(suffix)}$")
    present = {int(m.group(1)) for p in folder.iterdir() if (m := pattern.match(p.name))} if folder.exists() else set()
    intact = set()
    for step in present:
        record_path = folder / f"{prefix}{step}{suffix}.commit.json"
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            continue
        ok = True
        for entry in record["files"]:
            file = folder / entry["path"]
            data = file.read_bytes() if file.is_file() else None
            if data is None or len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["chunks"][0]:
                ok = False
        if ok:
            intact.add(step)
    return sorted(intact, reverse=True), sorted(present - intact, reverse=True)


def _log(message: str, **fields: Any) -> None:
    print(json.dumps({"severity": "DEBUG", "message": message, **fields}), flush=True)


def _install_pause_hooks() -> None:
    """Pauses for the tests, from ``WORKER_TEST_PAUSE_MID_SAVE_SECONDS`` (inside the framework's
    own write: part of the checkpoint written) and ``WORKER_TEST_PAUSE_BEFORE_COMMIT_SECONDS``
    (the framework's write done, no commit record yet). Each logs ``test pause`` first."""
    mid = float(os.environ.get("WORKER_TEST_PAUSE_MID_SAVE_SECONDS", "0") or 0)
    before = float(os.environ.get("WORKER_TEST_PAUSE_BEFORE_COMMIT_SECONDS", "0") or 0)
    if before:
        from gpu_resilience_worker.artifacts import ArtifactCheckpoints

        commit = ArtifactCheckpoints.commit

        def paused_commit(self: Any, step: int) -> Any:
            _log("test pause", where="before-commit", step=step)
            time.sleep(before)
            return commit(self, step)

        ArtifactCheckpoints.commit = paused_commit  # type: ignore[method-assign]
    if mid and "transformers" in sys.modules:
        from transformers import Trainer

        save_rng = Trainer._save_rng_state

        def paused_rng(self: Any, output_dir: str) -> None:  # weights and optimizer written, no trainer_state yet
            _log("test pause", where="mid-save", step=self.state.global_step)
            time.sleep(mid)
            save_rng(self, output_dir)

        Trainer._save_rng_state = paused_rng  # type: ignore[method-assign]
    if mid and "lightning" in sys.modules:
        import io

        import torch
        from lightning.pytorch.plugins.io.torch_plugin import TorchCheckpointIO

        save = TorchCheckpointIO.save_checkpoint

        def paused_save(self: Any, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "wb") as handle:  # half of the file, as a killed write leaves it
                handle.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            _log("test pause", where="mid-save", step=checkpoint.get("global_step"))
            time.sleep(mid)
            save(self, checkpoint, path, storage_options)

        TorchCheckpointIO.save_checkpoint = paused_save  # type: ignore[method-assign]


def _install_step_delay() -> None:
    """``WORKER_TEST_STEP_DELAY_SECONDS``: a sleep at every step end (before the integration's own
    step-end check), so that a chain of interruptions outlasts the training on a fast, idle machine
    as on a loaded one; a sleep changes no number the model computes."""
    delay = float(os.environ.get("WORKER_TEST_STEP_DELAY_SECONDS", "0") or 0)
    if not delay:
        return

    def slow(cls: type, name: str) -> None:
        original = getattr(cls, name)

        def delayed(self: Any, *args: Any, **kwargs: Any) -> Any:
            time.sleep(delay)
            return original(self, *args, **kwargs)

        setattr(cls, name, delayed)

    if "transformers" in sys.modules:
        from gpu_resilience_worker.integrations.transformers import CommitCallback

        slow(CommitCallback, "on_step_end")
    if "lightning" in sys.modules:
        from gpu_resilience_worker.integrations.lightning import CommitCheckpoint

        slow(CommitCheckpoint, "on_train_batch_end")


if os.environ.get("WORKER_TEST_PAUSE_MID_SAVE_SECONDS") or os.environ.get("WORKER_TEST_PAUSE_BEFORE_COMMIT_SECONDS"):
    _install_pause_hooks()
_install_step_delay()


GRACE_SECONDS = 10.0
#: Seconds slept at each step end of the chained attempts (not the baseline): at most about
#: ``max_delay / STEP_DELAY`` steps pass between an attempt's start and a random interruption,
#: so 2 n interruptions fit in the training whatever the machine's speed.
STEP_DELAY = os.environ.get("FRAMEWORK_STEP_DELAY", "0.03")


def _plan(n: int, rng: Any) -> list[tuple[signal.Signals, str]]:
    """``n`` SIGTERM and ``n`` SIGKILL, each kind with about a quarter during the framework's own
    write (at least 2), a fifth between that write and the commit record (at least 2), and the
    rest at a random time after training started; shuffled."""
    wheres = ["mid-save"] * max(2, n // 4) + ["before-commit"] * max(2, n // 5)
    wheres += ["random"] * max(0, n - len(wheres))
    plan = [(sig, where) for sig in (signal.SIGTERM, signal.SIGKILL) for where in wheres]
    rng.shuffle(plan)
    return plan


def torch_default_threads() -> int:
    """:return: the thread count torch picks in a fresh process with no ``OMP_NUM_THREADS``."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.strip())


def _threads(log: Path) -> list[int]:
    """:return: the thread counts an attempt's log reports (one per attempt that ended)."""
    return [r["threads"] for r in log_records(log) if r.get("message") == "torch threads"]


def run_chain(tmp_path: Path, *, block: str, modules: list[str], folder: str, prefix: str, suffix: str,
              max_delay: float, n: int = FAULTS_N, seed: int = 0) -> tuple[Path, Path, list[dict[str, Any]]]:
    """Run the example ``block`` once uninterrupted (``baseline/``) and once through ``2 n``
    interruptions chained in one folder (``chain/``), checking every attempt.

    Each attempt: the newest intact checkpoint before it (:func:`intact_steps`) is the one it
    resumes from, and every newer torn one is logged as skipped or removed; SIGTERM ends in exit
    143 within the grace period with nothing lost (the newest intact step afterwards is the step
    the job stopped at, or the final save was reported skipped); SIGKILL during the framework's
    write leaves a torn checkpoint. The baseline and every attempt that ends must report torch's
    default thread count (the machine's cores).

    :return: ``(baseline folder, chain folder, one row per attempt)``.
    """
    import random

    rng = random.Random(seed)
    script = tmp_path / "job.py"
    script.write_text(readme_block(block))
    rows: list[dict[str, Any]] = []
    with ForkServer(modules) as server:
        baseline = tmp_path / "baseline"
        baseline.mkdir()
        _, began = server.start(script, baseline, tmp_path / "baseline.log")
        status, ended = server.wait()
        print(f"\nbaseline: {ended - began:.2f} s, {server.threads} torch threads")
        assert status == 0, (tmp_path / "baseline.log").read_text()[-3000:]
        default_threads = torch_default_threads()
        assert server.threads == default_threads, (server.threads, default_threads)
        assert _threads(tmp_path / "baseline.log") == [default_threads]
        chain = tmp_path / "chain"
        chain.mkdir()
        plan = _plan(n, rng) + [(None, "to the end")]
        for index, (sig, where) in enumerate(plan):
            intact, torn = intact_steps(chain / folder, prefix, suffix)
            log = tmp_path / f"attempt-{index:02d}.log"
            env = {"PREEMPTION_GRACE_SECONDS": str(GRACE_SECONDS), "WORKER_TEST_STEP_DELAY_SECONDS": STEP_DELAY}
            if where == "mid-save":
                env["WORKER_TEST_PAUSE_MID_SAVE_SECONDS"] = "1.0"
            elif where == "before-commit":
                env["WORKER_TEST_PAUSE_BEFORE_COMMIT_SECONDS"] = "1.0"
            pid, began = server.start(script, chain, log, **env)
            sent = None
            if sig is not None:
                trigger = wait_for(log, "training started" if where == "random" else "test pause", server)
                assert trigger is not None, f"attempt {index}: no trigger line\n" + log.read_text()[-3000:]
                if where == "random":
                    time.sleep(rng.uniform(0.0, max_delay))
                sent = time.monotonic()
                assert server.running(), f"attempt {index}: ended before its {sig.name} (training too short)"
                os.kill(pid, sig)
            status, ended = server.wait()
            records = log_records(log)
            text = log.read_text()[-4000:]
            resumed = [r["step"] for r in records if r["message"] == "resuming from committed checkpoint"]
            assert resumed == intact[:1], f"attempt {index}: resumed {resumed}, newest intact {intact[:1]}\n{text}"
            dropped = {r["step"] for r in records if r["message"] in ("skipping checkpoint", "removing uncommitted checkpoint")}
            newer_torn = [s for s in torn if not intact or s > intact[0]]
            assert set(newer_torn) <= dropped, f"attempt {index}: torn {newer_torn} not skipped\n{text}"
            after_intact, after_torn = intact_steps(chain / folder, prefix, suffix)
            row = {"attempt": index, "signal": sig.name if sig else "-", "where": where,
                   "resumed": resumed[0] if resumed else None, "skipped_torn": newer_torn, "status": status,
                   "exit_s": round(ended - sent, 3) if sent else None,
                   "newest_after": after_intact[0] if after_intact else None, "wall_s": round(ended - began, 2)}
            rows.append(row)
            _check_end(row, sig, records, _threads(log), default_threads, sent, ended, after_intact, after_torn, text)
    _print_rows(rows)
    return baseline, chain, rows


def _check_end(row: dict[str, Any], sig: signal.Signals | None, records: list[dict[str, Any]], threads: list[int],
               expected_threads: int, sent: float | None, ended: float, after_intact: list[int],
               after_torn: list[int], text: str) -> None:
    """The checks of how an attempt ended (``row`` as :func:`run_chain` makes it): the last one
    exits 0; a SIGTERM exits 143 within the grace period with its stop step committed (or the
    final save reported skipped); a SIGKILL mid-save leaves a torn checkpoint newer than the
    newest intact one. An attempt that ends reports ``expected_threads``."""
    index, status, where = row["attempt"], row["status"], row["where"]
    if sig != signal.SIGKILL:  # an attempt that ends reports its thread count
        assert threads == [expected_threads], f"attempt {index}: threads {threads}\n{text}"
    if sig is None:
        assert status == 0, f"attempt {index}: the last attempt failed\n{text}"
    elif sig == signal.SIGTERM:
        assert status == 143, f"attempt {index}: SIGTERM exit {status}\n{text}"
        assert ended - sent < GRACE_SECONDS, f"attempt {index}: exit {ended - sent:.2f} s after SIGTERM"
        exiting = [r for r in records if r["message"] == "preempted: exiting"]
        skipped = any(r["message"].startswith("preempted: final save skipped") for r in records)
        assert exiting, text
        assert skipped or exiting[-1]["last_committed"] == exiting[-1]["step"] == row["newest_after"], \
            f"attempt {index}: stopped at {exiting[-1]}, newest intact {row['newest_after']}\n{text}"
    else:
        assert status == -signal.SIGKILL, f"attempt {index}: SIGKILL exit {status}\n{text}"
        if where == "mid-save":
            assert after_torn and (not after_intact or after_torn[0] > after_intact[0]), \
                f"attempt {index}: a kill mid-save left no torn checkpoint"


def _print_rows(rows: list[dict[str, Any]]) -> None:
    """Print one line per attempt of :func:`run_chain`."""
    print("\nattempt signal  where          resumed skipped_torn status exit_s newest_after wall_s")
    for r in rows:
        print(f"{r['attempt']:>7} {r['signal']:<7} {r['where']:<14} {str(r['resumed']):>7} "
              f"{str(r['skipped_torn']):>12} {r['status']:>6} {str(r['exit_s']):>6} {str(r['newest_after']):>12} {r['wall_s']:>6}")

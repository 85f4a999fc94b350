"""A checkpoint bucket outage of several minutes at a re-run decision (issue 39 item 1).

A chain that commits a newer checkpoint in every execution is preempted four times; at the fourth
decision (three re-runs used, as many as the fixed budget's default) the Storage API is cut off
for :data:`OUTAGE_SECONDS`: the port the operator reaches the GCS emulator on is closed (every
connection through it reset, new ones refused) and opened again on the same port. Longer than the
Storage client's own retry (120 s), after which the operator used to fall back to the fixed
budget of 3 and fail the progressing chain with ``CloudRunGpuFatalError``; now the decision retries
the read for ``progress_read_timeout`` (300 s by default) and decides on the steps it then reads.
The test lasts the outage and a little more.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import warnings

import pytest

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.overrides import execution_env
from airflow_gpu_resilience.job_spec import GpuJobSpec
from airflow_gpu_resilience.operators.cloud_run import START_STEPS_ENV, CloudRunGpuExecuteJobOperator
from tests.provider.conftest import BUCKET, PROJECT, REGION, bucket_dir

pytestmark = [pytest.mark.faults, pytest.mark.usefixtures("airflow_db")]

#: Seconds the Storage API stays unreachable: longer than the Storage client's 120 s retry.
OUTAGE_SECONDS = 180.0
CHAIN_IMAGE = "test.local/chain:latest"
#: Steps each execution commits; the execution that commits :data:`HOLD` waits for the test's go
#: file before it exits 143; the one that commits :data:`FINAL` exits 0.
STEP, HOLD, FINAL = 50, 200, 250

#: One execution of the chain: commits a checkpoint STEP newer than the newest (data, then its
#: commit record, as the worker does), then exits 143 (preempted) or, at FINAL, 0.
CHAIN_SCRIPT = r"""
import hashlib, json, os, pathlib, sys, time
step_size, hold, final = (int(a) for a in sys.argv[1:4])
root = pathlib.Path(os.environ["CHECKPOINT_DIR"])
ns = root / os.environ["CLOUD_RUN_JOB"] / ("task-" + os.environ["CLOUD_RUN_TASK_INDEX"])
ns.mkdir(parents=True, exist_ok=True)
step = max((int(p.name[5:13]) for p in ns.glob("ckpt-*.commit.json")), default=0) + step_size
data = b"state at step %d" % step
(ns / ("ckpt-%08d.pt" % step)).write_bytes(data)
(ns / ("ckpt-%08d.commit.json" % step)).write_text(
    json.dumps({"step": step, "size": len(data), "chunk_bytes": 4096, "chunks": [hashlib.sha256(data).hexdigest()],
                "sha256": hashlib.sha256(hashlib.sha256(data).digest()).hexdigest()}))  # one chunk's hash list
print("committed step", step, flush=True)
if step >= final:
    sys.exit(0)
go = root / (os.environ["CLOUD_RUN_JOB"] + ".go")
for _ in range(9000 if step >= hold else 0):
    if go.exists():
        break
    time.sleep(0.1)
sys.exit(143)
"""


class PortCut:
    """A TCP relay on a local port to the GCS emulator, whose port can be closed and opened again.

    :meth:`cut` closes the listening socket and resets every connection relayed so far (a client's
    kept-alive ones included), so the port refuses connections as a stopped server's does;
    :meth:`restore` listens on the same port again.

    :param target_port: the GCS emulator's port.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self.restore()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.1)
        self._listener = listener
        self._start(self._accept, listener)

    def cut(self) -> None:
        listener, self._listener = self._listener, None
        listener.close()
        with self._lock:
            live, self._sockets = self._sockets, set()
        for sock in live:
            _reset(sock)

    def close(self) -> None:
        if self._listener is not None:
            self.cut()
        for thread in self._threads:
            thread.join(timeout=5)

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by cut()
                return
            client.settimeout(None)
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets |= {client, upstream}
            self._start(self._pump, client, upstream)
            self._start(self._pump, upstream, client)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:  # reset by cut(), or the other side went away
            pass


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset (SO_LINGER 0), as a server that went away leaves its clients."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()
    except OSError:
        pass


@pytest.fixture
def outage_emulator(tmp_path, monkeypatch):
    """An emulator of its own with the chain image; the connection points at it, and
    ``STORAGE_EMULATOR_HOST`` at a :class:`PortCut` in front of its GCS emulator."""
    from urllib.parse import urlparse

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from cloud_run_emulator.process import EmulatorProcess

    table = tmp_path / "images.json"
    table.write_text(json.dumps({"images": {CHAIN_IMAGE: {"entrypoint": ["{python}", "-c", CHAIN_SCRIPT]}}}))
    with EmulatorProcess(tmp_path / "state", images_file=table, grace_seconds=1.0) as emu:
        storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                       client_options={"api_endpoint": emu.gcs_endpoint}).create_bucket(BUCKET)
        relay = PortCut(urlparse(emu.gcs_endpoint).port)
        extra = {"is_anonymous": True, "project": PROJECT, "api_endpoint": emu.endpoint}
        monkeypatch.setenv("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT",
                           json.dumps({"conn_type": "google_cloud_platform", "extra": extra}))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", relay.endpoint)
        try:
            yield emu, relay
        finally:
            relay.close()


class _TI:
    dag_id, run_id, task_id, map_index = "bucket_outage", "run-1", "execute", -1

    def xcom_push(self, key, value):
        pass


def test_a_progressing_chain_finishes_through_a_bucket_outage_of_several_minutes(outage_emulator, job_name):
    """Steps 0 -> 50 -> 100 -> 150 -> 200, each execution preempted, then 250 and success: the
    Storage API is unreachable from the fourth execution's end for 3 minutes, so the fourth
    decision cannot read the steps at first; it waits for the bucket and re-runs on the progress
    it then reads (the fixed budget of 3 re-runs would have ended the chain)."""
    emulator, relay = outage_emulator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # max_retries=0
        spec = GpuJobSpec(name=job_name, image=CHAIN_IMAGE, args=[str(STEP), str(HOLD), str(FINAL)],
                          max_retries=0, checkpoint_bucket=BUCKET)
    CloudRunGpuHook().create_job(job_name=job_name, job=spec, region=REGION, project_id=PROJECT)
    folder = bucket_dir(emulator)
    held = folder / job_name / "task-0" / f"ckpt-{HOLD:08d}.commit.json"
    outage: dict[str, float] = {}

    def cut_the_bucket_off() -> None:
        while not held.exists():
            time.sleep(0.1)
        relay.cut()
        outage["from"] = time.time()
        (folder / f"{job_name}.go").write_text("go")  # the held execution ends: the decision comes now
        time.sleep(OUTAGE_SECONDS)
        outage["to"] = time.time()
        relay.restore()

    controller = threading.Thread(target=cut_the_bucket_off, daemon=True)
    controller.start()
    op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION, deferrable=False,
                                       poll_interval=0.2, checkpoint_bucket=BUCKET)
    summary = op.execute({"ti": _TI()})
    controller.join(timeout=OUTAGE_SECONDS + 60)

    assert summary["outcome"] == "SUCCEEDED" and summary["reruns"] == 4 > op.max_preemption_reruns
    chain = summary["chain"]
    assert [c["outcome"] for c in chain] == ["PREEMPTED"] * 4 + ["SUCCEEDED"], chain
    assert [c["end_steps"] for c in chain] == [{"0": step} for step in (50, 100, 150, 200, 250)], chain
    assert all(c["progress"] is True for c in chain), chain
    # the fourth execution ended inside the outage and the fifth was started after it, on the
    # steps read once the bucket was back (recorded on the execution for every later try)
    executions = list(reversed(CloudRunGpuHook().list_executions(job_name=job_name, region=REGION,
                                                                 project_id=PROJECT)))
    assert outage["from"] < executions[3].completion_time.timestamp() < outage["to"]
    assert executions[4].create_time.timestamp() > outage["to"]
    assert execution_env(executions[4])[START_STEPS_ENV] == f"0={HOLD}"

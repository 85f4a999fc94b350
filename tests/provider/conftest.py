"""Shared fixtures for the provider's unit tests: the Airflow DB, the Cloud Run emulator, a connection.

Provider tests run against the local Cloud Run emulator (``cloud_run_emulator``),
never against mocks of the Cloud Run client. Task "images" are small ``python -c`` stand-ins
from the image table below; their behaviour is chosen with container args.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

PROJECT = "test-project"
REGION = "us-central1"
BUCKET = "test-checkpoints"
STUB_IMAGE = "test.local/stub:latest"

#: The stand-in task: ``ok`` | ``exit N`` | ``preempt-once`` (exit 143 until a marker exists in
#: the checkpoint dir, then 0) | ``sleep SECONDS`` | ``sleep-first SECONDS [LATER]`` (attempt 0
#: sleeps, later attempts exit 0 after LATER s, default 0.5) | ``preempt-then-sleep SECONDS``
#: (the first execution exits 143 at once; later ones sleep, then exit 143) | ``progress`` (the
#: worker's files: the first execution reports step 30/100 and exits 143, the second resumes
#: from step 20, losing 10 steps, and completes) | ``commit-then-stall SECONDS`` (commits a
#: checkpoint at step 40 once, then sleeps: no progress after the first execution) |
#: ``record-env NAME`` (writes env var NAME to ``{job}-env.txt`` in the bucket, then exits 0).
#: SIGTERM is not handled: death by signal 15.
STUB_SCRIPT = r"""
import os, pathlib, sys, time
mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
root = pathlib.Path(os.environ.get("CHECKPOINT_DIR", "."))
print("stub", mode, "attempt", os.environ.get("CLOUD_RUN_TASK_ATTEMPT"), flush=True)
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "preempt-once":
    marker = root / (os.environ["CLOUD_RUN_JOB"] + "-task" + os.environ["CLOUD_RUN_TASK_INDEX"] + ".marker")
    if marker.exists():
        sys.exit(0)
    marker.write_text(os.environ["CLOUD_RUN_EXECUTION"])
    sys.exit(143)
if mode == "sleep":
    time.sleep(float(sys.argv[2]))
if mode == "record-env":
    (root / (os.environ["CLOUD_RUN_JOB"] + "-env.txt")).write_text(os.environ.get(sys.argv[2], "<unset>"))
if mode == "commit-then-stall":
    import hashlib, json
    ns = root / os.environ["CLOUD_RUN_JOB"] / ("task-" + os.environ["CLOUD_RUN_TASK_INDEX"])
    ns.mkdir(parents=True, exist_ok=True)
    if not (ns / "ckpt-00000040.commit.json").exists():
        data = b"state at step 40"
        (ns / "ckpt-00000040.pt").write_bytes(data)
        (ns / "ckpt-00000040.commit.json").write_text(json.dumps(
            {"step": 40, "size": len(data), "chunk_bytes": 4096, "chunks": [hashlib.sha256(data).hexdigest()],
             "sha256": hashlib.sha256(hashlib.sha256(data).digest()).hexdigest()}))  # one chunk's hash list
    time.sleep(float(sys.argv[2]))
if mode == "sleep-first":
    later = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
    time.sleep(float(sys.argv[2]) if os.environ.get("CLOUD_RUN_TASK_ATTEMPT") == "0" else later)
if mode == "preempt-then-sleep":
    marker = root / (os.environ["CLOUD_RUN_JOB"] + "-task" + os.environ["CLOUD_RUN_TASK_INDEX"] + ".marker")
    if marker.exists():
        time.sleep(float(sys.argv[2]))
    marker.write_text(os.environ["CLOUD_RUN_EXECUTION"])
    sys.exit(143)
if mode == "progress":
    import json
    ns = root / os.environ["CLOUD_RUN_JOB"] / ("task-" + os.environ["CLOUD_RUN_TASK_INDEX"])
    ns.mkdir(parents=True, exist_ok=True)
    ident = {"execution": os.environ["CLOUD_RUN_EXECUTION"], "attempt": int(os.environ["CLOUD_RUN_TASK_ATTEMPT"]),
             "task_index": int(os.environ["CLOUD_RUN_TASK_INDEX"])}
    first = not (ns / "attempts.json").exists()
    attempts = [] if first else json.loads((ns / "attempts.json").read_text())["attempts"]
    attempts.append({**ident, "resumed_from_step": 0 if first else 20, "lost_steps": 0 if first else 10})
    (ns / "attempts.json").write_text(json.dumps({"attempts": attempts}))
    step, status = (30, "running") if first else (100, "completed")
    (ns / "progress.json").write_text(json.dumps({"step": step, "total_steps": 100, "status": status,
        "updated_at": "2026-01-01T00:00:00Z", "loss": 0.5, "steps_per_second": 10.0}))
    if first:
        time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
        sys.exit(143)
    (ns / "metrics.json").write_text(json.dumps({"steps": 100, "attempts": attempts, "history": attempts}))
sys.exit(0)
"""


@pytest.fixture(scope="session")
def airflow_db() -> None:
    """Migrate the (temporary, SQLite) Airflow metadata DB once per session."""
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True, timeout=300)


@contextlib.contextmanager
def stub_emulator(data_dir: Path, **settings):
    """A Cloud Run emulator (with its GCS emulator) in ``data_dir`` whose image table maps
    ``STUB_IMAGE`` to the stand-in task, with ``BUCKET`` created.

    :param settings: further :class:`~cloud_run_emulator.process.EmulatorProcess`
        arguments (a read quota, say).
    """
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from cloud_run_emulator.process import EmulatorProcess

    table = data_dir / "images.json"
    table.write_text(json.dumps({"images": {STUB_IMAGE: {"entrypoint": ["{python}", "-c", STUB_SCRIPT], "cmd": ["ok"]}}}))
    with EmulatorProcess(data_dir / "state", images_file=table, grace_seconds=1.0, **settings) as emu:
        storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                       client_options={"api_endpoint": emu.gcs_endpoint}).create_bucket(BUCKET)
        yield emu


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    """A Cloud Run emulator (with its GCS emulator) for the whole session, with ``BUCKET`` created."""
    with stub_emulator(tmp_path_factory.mktemp("emulator")) as emu:
        yield emu


#: The transports the provider's tests run on (:func:`transport`'s parameters, test ids ``[rest]``/``[grpc]``).
TRANSPORTS = ("rest", "grpc")


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    """The transport a test talks to Cloud Run over: each test that uses it (through
    :func:`gcp_conn`, or an emulator of its own through :func:`point_connection`) runs once per
    transport, test ids ``[rest]`` and ``[grpc]``. ``@pytest.mark.parametrize("transport",
    ["rest"], indirect=True)`` keeps a test to one."""
    return request.param


def point_connection(monkeypatch, emulator, transport: str) -> str:
    """Point ``google_cloud_default`` at ``emulator`` (anonymous, project ``test-project``) over
    ``transport``: REST through the connection's ``api_endpoint``; gRPC through
    ``CLOUD_RUN_EMULATOR_HOST``, with no Cloud Run endpoint in the connection (Cloud Logging
    still reads the emulator's REST server, through ``logging_api_endpoint``).

    :param monkeypatch: the test's, which undoes the environment changes afterwards.
    :param emulator: a running :class:`~cloud_run_emulator.process.EmulatorProcess`.
    :param transport: ``"rest"`` or ``"grpc"``.
    :returns: the connection id, ``google_cloud_default``.
    :raises ValueError: another ``transport``.
    """
    extra = {"is_anonymous": True, "project": PROJECT}
    if transport == "rest":
        extra["api_endpoint"] = emulator.endpoint
        monkeypatch.delenv("CLOUD_RUN_EMULATOR_HOST", raising=False)
    elif transport == "grpc":
        extra["logging_api_endpoint"] = emulator.endpoint
        monkeypatch.setenv("CLOUD_RUN_EMULATOR_HOST", emulator.grpc_endpoint)
    else:
        raise ValueError(f"transport={transport!r}: use one of {TRANSPORTS}")
    monkeypatch.setenv(
        "AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT", json.dumps({"conn_type": "google_cloud_platform", "extra": extra})
    )
    from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook

    # the test id names the transport: the hook's clients must use it (a test marked [grpc] that
    # talked REST would pass unnoticed)
    built = type(CloudRunGpuHook().jobs_client(REGION).transport).__name__
    assert built == f"Jobs{'Rest' if transport == 'rest' else 'Grpc'}Transport", (transport, built)
    return "google_cloud_default"


def pytest_collection_modifyitems(config, items) -> None:
    """On Airflow 2 (``make test-airflow2``), deselect the REST variants of the tests with an
    emulator of their own (``worker_emulator``: the bundled worker's runs, the slowest provider
    tests); their gRPC variants run there, and both variants on Airflow 3 (``make test``).

    Why the Airflow release does not matter to the transport: REST and gRPC differ only in the
    Cloud Run clients the hook builds (the google provider's ``GoogleBaseHook`` and
    ``google-cloud-run``, client code whichever releases each environment resolves) and in how the trigger
    calls them (a thread per call or native ``grpc.aio``), none of it Airflow's code; what does
    depend on the release (connections, operators, deferral) the gRPC variant runs on each. The
    tests of the session's emulator run both variants on both releases.
    """
    from airflow import __version__ as airflow_version

    if int(airflow_version.split(".")[0]) >= 3:
        return
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        rest = callspec is not None and callspec.params.get("transport") == "rest"
        (dropped if rest and "worker_emulator" in getattr(item, "fixturenames", ()) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture
def gcp_conn(emulator, monkeypatch, transport) -> str:
    """``google_cloud_default`` pointed at the session's emulator, once per transport
    (:func:`transport`, :func:`point_connection`)."""
    return point_connection(monkeypatch, emulator, transport)


@pytest.fixture
def job_name() -> str:
    """A fresh job id per test, so that tests never share emulator state."""
    return f"job-{uuid.uuid4().hex[:10]}"


def bucket_dir(emulator) -> Path:
    """Local directory backing the test checkpoint bucket."""
    return Path(emulator.bucket_dir(BUCKET))


def wait_until_running(hook, execution: str, task_index: int = 0, timeout: float = 20.0) -> None:
    """Block until the task's current attempt has started (so that it can be preempted)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tasks = hook.list_tasks(execution=execution)
        if tasks and tasks[task_index].start_time and hook.get_execution(execution=execution).running_count:
            return
        time.sleep(0.05)
    raise TimeoutError(f"task {task_index} of {execution} did not start within {timeout} s")


@pytest.fixture
def faults(emulator):
    """Configure the emulator's API faults (``POST /_emulator/faults``); cleared afterwards."""
    from cloud_run_emulator.process import post_json

    def configure(**body):
        post_json(emulator.endpoint + "/_emulator/faults", body)

    yield configure
    configure()


@pytest.fixture
def gcs_emulator_host(emulator, monkeypatch) -> str:
    """``STORAGE_EMULATOR_HOST`` for this test: ``GCSHook`` reads the emulator's buckets."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.gcs_endpoint)
    return emulator.gcs_endpoint

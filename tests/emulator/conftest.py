"""Fixtures for emulator tests: stand-in images, one emulator subprocess per session, the real
``run_v2`` clients pointed at it (REST: ``jobs``, ``executions``, ``tasks``; gRPC on an insecure
channel: ``grpc_jobs``, ``grpc_executions``, ``grpc_tasks``), and a GCS client on its storage
emulator; the helpers the API tests share (:func:`create`, :func:`wait_running`,
:func:`poll_execution`, :func:`google_status`) and the Cloud Storage FUSE mounts the
``test_gcsfuse*.py`` files share (``fuse_bucket``, ``mnt``, ``strict``)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import run_v2
from google.cloud.run_v2.services.executions.transports import ExecutionsGrpcTransport
from google.cloud.run_v2.services.jobs.transports import JobsGrpcTransport
from google.cloud.run_v2.services.tasks.transports import TasksGrpcTransport

from cloud_run_emulator.gcsfuse import GcsFuseMount
from cloud_run_emulator.process import EmulatorProcess

PARENT = "projects/test-project/locations/us-central1"

# Each stand-in image is a small python -c script. OUT (if set) is a directory to which the
# attempt writes "task-{index}/attempt-{attempt}.json" with its CLOUD_RUN_* env and times.
_RECORD = (
    "import json,os,sys,time,signal\n"
    "E=os.environ\n"
    "def record(**kw):\n"
    "    out=E.get('OUT')\n"
    "    if not out: return\n"
    "    d=os.path.join(out,'task-'+E['CLOUD_RUN_TASK_INDEX']); os.makedirs(d,exist_ok=True)\n"
    "    info={k:v for k,v in E.items() if k.startswith('CLOUD_RUN_')}; info.update(kw)\n"
    "    open(os.path.join(d,'attempt-'+E['CLOUD_RUN_TASK_ATTEMPT']+'.json'),'w').write(json.dumps(info))\n"
)
EXIT_SCRIPT = _RECORD + (
    "t0=time.time(); time.sleep(float(E.get('SLEEP','0')))\n"
    "record(start=t0,end=time.time(),argv=sys.argv[1:])\n"
    "print('attempt',E['CLOUD_RUN_TASK_ATTEMPT'],'exiting',E.get('CODE','0'),flush=True)\n"
    "sys.exit(int(E.get('CODE','0')))\n"
)
# Sleeps SLEEP seconds on attempts below FAST_FROM (default 1), traps SIGTERM -> exit 143.
SLEEP_SCRIPT = _RECORD + (
    "def term(*_):\n"
    "    print('SIGTERM received, exiting 143',flush=True); record(interrupted=True); sys.exit(143)\n"
    "signal.signal(signal.SIGTERM,term)\n"
    "print('started',flush=True)\n"
    "if int(E['CLOUD_RUN_TASK_ATTEMPT'])<int(E.get('FAST_FROM','1')): time.sleep(float(E.get('SLEEP','60')))\n"
    "record(interrupted=False); print('done',flush=True)\n"
)
# A short shell command for many-task runs: tasks whose index is 7 mod 50 fail their first attempt.
SHORT_SCRIPT = ('echo "task $CLOUD_RUN_TASK_INDEX attempt $CLOUD_RUN_TASK_ATTEMPT"; '
                '[ $((CLOUD_RUN_TASK_INDEX % 50)) -eq 7 ] && [ "$CLOUD_RUN_TASK_ATTEMPT" = 0 ] && exit 1; exit 0')
STUBBORN_SCRIPT = (
    "import signal,time\nsignal.signal(signal.SIGTERM,signal.SIG_IGN)\nprint('started',flush=True)\ntime.sleep(60)\n"
)


@pytest.fixture(scope="session")
def images_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("images") / "images.json"
    images = {
        "local/exit:latest": {"entrypoint": ["{python}", "-c", EXIT_SCRIPT], "cmd": ["default-cmd"]},
        "local/sleep:*": {"entrypoint": ["{python}", "-c", SLEEP_SCRIPT]},
        "local/stubborn": {"entrypoint": ["{python}", "-c", STUBBORN_SCRIPT]},
        "local/short": {"entrypoint": ["/bin/sh", "-c", SHORT_SCRIPT]},
        "local/sh": {"entrypoint": ["/bin/sh", "-c"]},  # the job's args[0] is the script
        "local/true": {"entrypoint": ["true"]},  # the cheapest task there is
        # writes its working folder to $OUT; its cwd (this folder) plays the image's WORKDIR /src
        "local/pwd": {"entrypoint": ["/bin/sh", "-c", 'pwd > "$OUT"'], "workdir": "/src"},
        # an entry no process can be started with (Popen refuses the env name): its supervisor fails
        "local/bad-env": {"entrypoint": ["/bin/true"], "env": {"A=B": "1"}},
    }
    path.write_text(json.dumps({"images": images}))
    return path


@pytest.fixture(scope="session")
def emulator(tmp_path_factory, images_file):
    """The session's emulator, also standing in for ``run.googleapis.com:443`` (``--google-endpoint``)."""
    with EmulatorProcess(tmp_path_factory.mktemp("emulator"), images_file=images_file, grace_seconds=2.0,
                         extra_args=["--google-endpoint"]) as emu:
        yield emu


def _opts(emu):
    return {"credentials": AnonymousCredentials(), "transport": "rest",
            "client_options": {"api_endpoint": emu.endpoint}}


@pytest.fixture(scope="session")
def jobs(emulator):
    return run_v2.JobsClient(**_opts(emulator))


@pytest.fixture(scope="session")
def executions(emulator):
    return run_v2.ExecutionsClient(**_opts(emulator))


@pytest.fixture(scope="session")
def tasks(emulator):
    return run_v2.TasksClient(**_opts(emulator))


@pytest.fixture(scope="session")
def grpc_channel(emulator):
    """An insecure channel to the emulator's gRPC server (as ``*_EMULATOR_HOST`` clients open)."""
    channel = grpc.insecure_channel(emulator.grpc_endpoint)
    yield channel
    channel.close()


@pytest.fixture(scope="session")
def grpc_jobs(grpc_channel):
    return run_v2.JobsClient(transport=JobsGrpcTransport(channel=grpc_channel))


@pytest.fixture(scope="session")
def grpc_executions(grpc_channel):
    return run_v2.ExecutionsClient(transport=ExecutionsGrpcTransport(channel=grpc_channel))


@pytest.fixture(scope="session")
def grpc_tasks(grpc_channel):
    return run_v2.TasksClient(transport=TasksGrpcTransport(channel=grpc_channel))


@pytest.fixture(scope="session")
def storage_client(emulator):
    """google-cloud-storage on the emulator's GCS endpoint (no process-wide STORAGE_EMULATOR_HOST,
    so other test packages in the same session are unaffected)."""
    from google.cloud import storage

    return storage.Client(project="test-project", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": emulator.gcs_endpoint})


@pytest.fixture
def bucket(storage_client):
    return storage_client.create_bucket(f"ckpt-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def job_id():
    return f"job-{uuid.uuid4().hex[:8]}"


def make_job(image, env=None, task_count=1, parallelism=0, max_retries=None, timeout_s=None,
             bucket=None, gpu=False, args=None, launch_stage=None) -> run_v2.Job:
    """A job with one container; a GCS volume 'ckpt' at /checkpoints when ``bucket`` is given."""
    container = run_v2.Container(image=image, env=[run_v2.EnvVar(name=k, value=v) for k, v in (env or {}).items()],
                                 args=args or [])
    template = run_v2.TaskTemplate(containers=[container])
    if max_retries is not None:
        template.max_retries = max_retries
    if timeout_s is not None:
        template.timeout = {"seconds": timeout_s}
    if bucket is not None:
        template.volumes = [run_v2.Volume(name="ckpt", gcs=run_v2.GCSVolumeSource(bucket=bucket))]
        container.volume_mounts = [run_v2.VolumeMount(name="ckpt", mount_path="/checkpoints")]
    if gpu:
        container.resources = run_v2.ResourceRequirements(limits={"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"})
        template.node_selector = run_v2.NodeSelector(accelerator="nvidia-l4")
        template.gpu_zonal_redundancy_disabled = True
    template.containers = [container]
    job = run_v2.Job(template=run_v2.ExecutionTemplate(task_count=task_count, parallelism=parallelism, template=template))
    if launch_stage is not None:
        job.launch_stage = launch_stage
    return job


def task_name(execution_name: str, index: int) -> str:
    short = execution_name.rsplit("/", 1)[-1]
    return f"{execution_name}/tasks/{short}-task{index}"


def create(jobs, job_id, job) -> run_v2.Job:
    """Create ``job`` as ``PARENT/jobs/job_id`` and wait for its operation."""
    return jobs.create_job(parent=PARENT, job=job, job_id=job_id).result(timeout=10)


def wait_running(tasks, name, timeout=10.0) -> run_v2.Task:
    """Wait until the task's first attempt has printed 'started' (its SIGTERM handler is set)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task = tasks.get_task(name=name)
        if task.start_time and task.retried == 0 and b"started" in _read(task.log_uri):
            return task
        time.sleep(0.05)
    raise AssertionError(f"{name} never started")


def _read(url: str) -> bytes:
    """The body behind ``url`` (a task's log URI), empty while it answers an HTTP error."""
    try:
        with urllib.request.urlopen(url) as response:
            return response.read()
    except urllib.error.HTTPError:
        return b""


def poll_execution(executions, name: str, timeout: float = 30.0) -> run_v2.Execution:
    """Poll ``get_execution`` until the execution has a completion time."""
    deadline = time.monotonic() + timeout
    while not (execution := executions.get_execution(name=name)).completion_time:
        assert time.monotonic() < deadline, f"{name} did not finish"
        time.sleep(0.1)
    return execution


def google_status(excinfo) -> str:
    """The ``error.status`` of the JSON error body (the REST client maps by HTTP code only)."""
    return excinfo.value.response.json()["error"]["status"]


@pytest.fixture(scope="session")
def fuse_bucket(storage_client):
    """The bucket the FUSE tests mount (one a session, shared by the ``test_gcsfuse*.py`` files)."""
    return storage_client.create_bucket(f"fuse-{uuid.uuid4().hex[:10]}")


def _mount(emulator, bucket, strict, options=(), name=None):
    """A (not yet started) FUSE mount of ``bucket`` under the emulator's data folder."""
    base = Path(emulator.data_dir, "fuse-tests", f"{bucket.name}-{name or ('strict' if strict else 'normal')}")
    return GcsFuseMount(emulator.bucket_dir(bucket.name), base / "mnt", base / "state", strict=strict,
                        options=options)


@pytest.fixture(scope="session")
def mnt(emulator, fuse_bucket):
    """A mount of ``fuse_bucket`` with gcsfuse's default semantics (staged writes fall back)."""
    with _mount(emulator, fuse_bucket, strict=False) as mount:
        yield mount


@pytest.fixture(scope="session")
def strict(emulator, fuse_bucket):
    """A strict mount of ``fuse_bucket`` (a staged write is ``EIO``), ``rename-dir-limit=5``."""
    with _mount(emulator, fuse_bucket, strict=True, options=["rename-dir-limit=5"]) as mount:
        yield mount


def _name(prefix="f"):
    """A fresh object name, so that tests sharing a mount never meet."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _events(mount, name, kind=None):
    """The mount's gcsfuse event records for object ``name`` (of ``kind``, if given)."""
    return [e for e in mount.events() if e["object"] == name and (kind is None or e["kind"] == kind)]


def _put(mount, name, data=b"0123456789"):
    """Write ``data`` as a new file through ``mount`` (uploaded at its close)."""
    with open(mount.mountpoint / name, "wb") as f:
        f.write(data)

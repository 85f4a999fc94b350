"""Run the emulator as a subprocess: for tests, the demo and local development.

Example::

    with EmulatorProcess(tmp_path, images_file="images.json") as emu:
        jobs = run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest",
                                 client_options={"api_endpoint": emu.endpoint})
        # or gRPC, the clients' default transport:
        jobs = run_v2.JobsClient(transport=JobsGrpcTransport(channel=grpc.insecure_channel(emu.grpc_endpoint)))
        os.environ["STORAGE_EMULATOR_HOST"] = emu.gcs_endpoint
        os.environ["CLOUD_RUN_EMULATOR_HOST"] = emu.grpc_endpoint  # the provider's hook then uses gRPC
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Mapping, Optional, Sequence

from .mount_options import mount_key, parse_mount_options
from .gcs import bucket_path

#: Environment that keeps google-auth from probing a metadata server (nothing local reaches
#: Google Cloud): set it in processes whose Google clients talk to the emulators.
OFFLINE_ENV = {
    "NO_GCE_CHECK": "true",
    "GCE_METADATA_HOST": "127.0.0.1:9",
    "GCE_METADATA_IP": "127.0.0.1:9",
    "CLOUDSDK_CONFIG": "",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
}


def post_json(url: str, payload: Optional[dict], timeout: float = 30.0, method: str = "POST") -> dict:
    """Send ``payload`` as JSON (``None``: no body); return the decoded answer (errors as Google
    error JSON). ``method`` may also be ``GET`` or ``DELETE``."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b"{}")


class EmulatorProcess:
    """``serve --port 0 --grpc-port 0 --gcs-port 0`` in a child process, as a context manager.

    Once entered, ``endpoint`` is the REST API (``http://127.0.0.1:PORT``),
    ``grpc_endpoint`` the gRPC API (``127.0.0.1:PORT``, for ``CLOUD_RUN_EMULATOR_HOST``) and
    ``gcs_endpoint`` the GCS emulator; with ``extra_args=["--google-endpoint"]``,
    :attr:`google_endpoint_env` is the environment that leads a new process's gRPC channels to
    ``run.googleapis.com:443`` here (see :mod:`.google_endpoint`; ``{}`` without the flag).

    :param data_dir: the emulator's data directory (created if missing).
    :param images_file: image table JSON (see :mod:`.images`), a list of them (combined), or ``None``.
    :param grace_seconds: preemption/timeout/cancel grace in seconds (default 10).
    :param extra_args: more ``serve`` arguments.
    :param start_timeout: seconds to wait for the ready line (default 30).
    :param max_task_processes: task processes running at once over all executions (``serve
        --max-task-processes``; ``None``, the default: the emulator's default, see
        :func:`~.runtime.default_max_task_processes`).
    :param read_quota_per_minute: Admin API reads admitted per minute per project and region
        (``serve --read-quota-per-minute``, see :mod:`.quota`); ``None``: Cloud Run's, as ``serve``.
        The default here is 0, off: tests and the demo poll every 0.05 to 2 s and create dozens of
        jobs a minute in one project and region, far above what Cloud Run admits; a caller
        checking that it stays within Cloud Run's quotas passes ``None`` or a limit.
    :param write_quota_per_minute: Admin API writes likewise (default 0, off; ``None``: Cloud Run's).
    :param quota_window_seconds: the quotas' window (``None``, the default: 60 s).
    :param program: the command that runs the emulator, before ``serve`` (default this
        interpreter's ``python -m cloud_run_emulator``; e.g. an installed ``cloud-run-emulator``
        console script).
    :param env: the server's environment (default: this process's).
    """

    def __init__(self, data_dir, images_file=None, grace_seconds: float = 10.0, extra_args=(),
                 start_timeout: float = 30.0, max_task_processes: Optional[int] = None,
                 read_quota_per_minute: Optional[int] = 0, write_quota_per_minute: Optional[int] = 0,
                 quota_window_seconds: Optional[float] = None,
                 program: Sequence[str] = (sys.executable, "-m", "cloud_run_emulator"),
                 env: Optional[Mapping[str, str]] = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self._env = None if env is None else dict(env)
        self._argv = [*program, "serve", "--port", "0",
                      "--grpc-port", "0", "--gcs-port", "0", "--data-dir", str(self.data_dir),
                      "--grace-seconds", str(grace_seconds)]
        for flag, value in (("--read-quota-per-minute", read_quota_per_minute),
                            ("--write-quota-per-minute", write_quota_per_minute),
                            ("--quota-window-seconds", quota_window_seconds)):
            if value is not None:
                self._argv += [flag, str(value)]
        if max_task_processes is not None:
            self._argv += ["--max-task-processes", str(max_task_processes)]
        tables = images_file if isinstance(images_file, (list, tuple)) else [images_file]
        for table in (t for t in tables if t is not None):
            self._argv += ["--images", str(table)]
        self._argv += list(extra_args)
        self._start_timeout = start_timeout
        self._popen: Optional[subprocess.Popen] = None
        self.endpoint = self.grpc_endpoint = self.gcs_endpoint = ""
        self.children: list = []
        self.google_endpoint_env: dict = {}

    def __enter__(self) -> "EmulatorProcess":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / "emulator.log", "ab")
        self._popen = subprocess.Popen(self._argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                       env=self._env)
        log.close()
        readable, _, _ = select.select([self._popen.stdout], [], [], self._start_timeout)
        line = self._popen.stdout.readline() if readable else b""  # the ready line, or EOF
        if not line:
            self._popen.kill()
            self._popen.wait()
            raise RuntimeError(f"emulator did not start (exit {self._popen.returncode}); "
                               f"see {self.data_dir / 'emulator.log'}")
        ready = json.loads(line)
        self.endpoint, self.grpc_endpoint = ready["endpoint"], ready["grpcEndpoint"]
        self.gcs_endpoint = ready["gcsEndpoint"]
        self.google_endpoint_env = ready.get("googleEndpointEnv", {})
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def bucket_dir(self, bucket: str) -> Path:
        """Local directory backing ``bucket`` (what a GCS volume mount of it sees)."""
        return bucket_path(self.data_dir, bucket)

    def volumes(self) -> dict:
        """How cloud-storage volumes are served and their events' counts (``/_emulator/volumes``)."""
        return self._admin("GET", "/_emulator/volumes", None)

    def volume_dir(self, bucket: str, mount_options=()) -> Path:
        """The folder a task of this emulator sees for ``bucket``: its FUSE mount point once an
        attempt mounted it (with ``mount_options``), else the bucket's folder (with ``only-dir``,
        that folder of it)."""
        wanted = parse_mount_options(mount_options, emulator=True)
        only_dir = wanted.pop("only-dir", "")
        for mount in self.volumes()["mounts"]:
            if mount_key(parse_mount_options(mount["mountOptions"], emulator=True)) == mount_key(wanted):
                return Path(mount["mountpoint"]) / bucket / only_dir
        return self.bucket_dir(bucket) / only_dir

    def preempt(self, execution: str, task_index: int = 0, grace_seconds: Optional[float] = None) -> dict:
        """Maintenance-preempt a running task; returns ``{"task", "attempt", "pid"}``.

        :raises RuntimeError: with the emulator's error when the task is not running.
        """
        payload = {"execution": execution, "taskIndex": task_index}
        if grace_seconds is not None:
            payload["graceSeconds"] = grace_seconds
        answer = post_json(self.endpoint + "/_emulator/preempt", payload)
        if "error" in answer:
            raise RuntimeError(answer["error"]["message"])
        return answer

    def schedule_preemptions(self, mean_seconds: float, seed: int = 0, name_prefix: str = "",
                             grace_seconds: Optional[float] = None, max_preemptions: int = 0) -> dict:
        """Start (replace) a seeded preemption schedule; returns its status (see :mod:`.faults`)."""
        plan = {"meanSeconds": mean_seconds, "seed": seed, "namePrefix": name_prefix,
                "graceSeconds": grace_seconds, "maxPreemptions": max_preemptions}
        return self._admin("POST", "/_emulator/preemptions/schedule", plan)

    def preemption_schedule(self, stop: bool = False) -> dict:
        """The schedule's status and preemptions so far; ``stop=True`` stops it first."""
        return self._admin("DELETE" if stop else "GET", "/_emulator/preemptions/schedule", None)

    def task_processes(self) -> dict:
        """``{"limit", "running", "peak"}``: task processes allowed, running now and at most at
        once so far, over all executions (``/_emulator/health``)."""
        return self._admin("GET", "/_emulator/health", None)["taskProcesses"]

    def attempts(self, name: str) -> list:
        """Every ended attempt of an execution (or task): see ``/_emulator/attempts`` in :mod:`.app`."""
        return self._admin("GET", f"/_emulator/attempts/{name}", None)["attempts"]

    def requests(self, project: Optional[str] = None, region: Optional[str] = None, reset: bool = False) -> dict:
        """The API request counters (``/_emulator/requests``, see :mod:`.app`), of one project
        and/or region when given; ``reset=True`` reads all and zeroes them."""
        if reset:
            return self._admin("DELETE", "/_emulator/requests", None)
        query = urllib.parse.urlencode({k: v for k, v in (("project", project), ("region", region)) if v is not None})
        return self._admin("GET", "/_emulator/requests" + (f"?{query}" if query else ""), None)

    def _admin(self, method: str, path: str, payload: Optional[dict]) -> dict:
        answer = post_json(self.endpoint + path, payload, method=method)
        if "error" in answer:
            raise RuntimeError(answer["error"]["message"])
        return answer

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server, wait, and check that no process it started is left.

        :raises RuntimeError: if a descendant process survived the server.
        """
        import psutil  # only needed to check for leftovers

        if self._popen is None or self._popen.poll() is not None:
            return
        try:
            self.children = psutil.Process(self._popen.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            self.children = []
        self._popen.send_signal(signal.SIGTERM)
        try:
            self._popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait()
        self._popen.stdout.close()
        survivors = [c for c in self.children if _alive(c)]
        if survivors:
            raise RuntimeError(f"emulator left processes running: {[c.pid for c in survivors]}")


def _alive(proc) -> bool:
    import psutil

    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.05)
    return True

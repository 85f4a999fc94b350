"""Assemble and run the emulator: GCS emulator, backends, FastAPI app, uvicorn, gRPC server.

Everything binds to 127.0.0.1; both HTTP servers apply the checks of :mod:`.guards` (loopback
``Host``, no foreign ``Origin``, JSON bodies, a body limit), and the gRPC server, which serves
the same backends, speaks HTTP/2 gRPC only (see :mod:`.grpc_server`). Once all accept
connections one JSON line is printed to stdout: ``{"ready": true, "endpoint", "grpcEndpoint",
"gcsEndpoint", "dataDir", "pid", "env"}`` (``endpoint`` is REST, ``http://127.0.0.1:PORT``;
``grpcEndpoint`` is ``127.0.0.1:PORT``; ``env`` the variables that lead clients here:
``CLOUD_RUN_EMULATOR_HOST``, the gRPC address, which a plain ``google-cloud-run`` client reads into
an insecure channel, and ``STORAGE_EMULATOR_HOST``, the GCS emulator, which
``google-cloud-storage`` reads itself; with ``--google-endpoint`` also ``googleEndpointEnv``, see
:mod:`.google_endpoint`). On SIGTERM or
SIGINT uvicorn stops, then the gRPC server, then every task attempt's process group gets SIGTERM,
and SIGKILL after a short grace, before the process exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence, Union

import uvicorn

from . import cloud_build, google_endpoint, grpc_server
from .app import AppState, create_app
from .backend import Registry
from .faults import ApiFaults, PreemptionPlan
from .gcs import GcsService
from .gcsfuse import VolumeMounts
from .group_reaper import GROUPS
from .images import ImageTable
from .quota import QuotaSettings, RequestQuota
from .runtime import RuntimeConfig, RuntimePolicy


@dataclasses.dataclass
class ServeConfig:
    """Settings of ``serve``.

    :param data_dir: directory for GCS objects (``gcs/``) and attempt logs (``logs/``).
    :param port: REST API port on 127.0.0.1; 0 picks a free one.
    :param grpc_port: gRPC API port on 127.0.0.1; 0 picks a free one.
    :param gcs_port: GCS emulator port; 0 picks a free one.
    :param images_file: image table JSON (see :mod:`.images`), a list of them (combined), or
        ``None`` for an empty one.
    :param shutdown_grace_seconds: grace for task processes when the emulator stops (s).
    :param policy: retry, grace and pacing settings (see :class:`~.runtime.RuntimePolicy`).
    :param preemptions: a seeded preemption schedule to start with the server, or ``None``.
    :param volumes: how ``cloud-storage`` volumes are served: ``auto`` (FUSE when available,
        else folders), ``fuse`` or ``folder`` (see :mod:`.gcsfuse`).
    :param fuse_strict: strict mode of the FUSE volumes (staging becomes ``EIO``).
    :param google_endpoint: also stand in for ``run.googleapis.com:443`` (a TLS gRPC port behind
        an HTTP ``CONNECT`` proxy; see :mod:`.google_endpoint`) and put the environment that
        leads gRPC there in the ready line's ``googleEndpointEnv``.
    :param quota: the Admin API request quota per project and region, over both transports
        (default: Cloud Run's, 600 reads and 60 writes a minute; see :mod:`.quota`).
    """

    data_dir: Path
    port: int = 8123
    grpc_port: int = 8124
    gcs_port: int = 9023
    images_file: Union[None, Path, Sequence[Path]] = None
    shutdown_grace_seconds: float = 2.0
    policy: RuntimePolicy = dataclasses.field(default_factory=RuntimePolicy)
    preemptions: Optional[PreemptionPlan] = None
    volumes: str = "auto"
    fuse_strict: bool = False
    google_endpoint: bool = False
    quota: QuotaSettings = dataclasses.field(default_factory=QuotaSettings)


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after shutting down, which would end the process before
    the task processes are stopped; this server only asks to exit and lets :func:`serve` clean up."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _announce(server: _Server, ready: dict) -> None:
    while not server.started and not server.should_exit:
        time.sleep(0.01)
    if server.started:
        print(json.dumps(ready), flush=True)


def serve(config: ServeConfig) -> None:
    """Run until SIGTERM/SIGINT; then stop every child process this emulator started."""
    data_dir = Path(config.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", config.port))
    endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
    gcs = GcsService(data_dir, config.gcs_port)
    mounts = VolumeMounts(data_dir, gcs.bucket_dir, mode=config.volumes, strict=config.fuse_strict)
    runtime = RuntimeConfig(data_dir=data_dir, images=ImageTable.load(config.images_file), gcs=gcs,
                            policy=config.policy, mounts=mounts)
    registry = Registry(runtime, endpoint)
    others = cloud_build.services(registry)
    state = AppState(registry, ApiFaults(), gcs, data_dir, mounts=mounts, quota=RequestQuota(config.quota),
                     services=others)
    server = _Server(uvicorn.Config(create_app(state), log_level="warning", lifespan="off"))
    identity = google_endpoint.make_identity(data_dir / "google-tls") if config.google_endpoint else None
    rpc_server, grpc_endpoint, tls_port = grpc_server.start(registry, state.faults, state.quota, config.grpc_port,
                                                            identity[:2] if identity else None,  # first to fail
                                                            others=[r for service in others for r in service.rpcs()])
    proxy = google_endpoint.ConnectProxy(tls_port).start() if identity else None
    print(mounts.banner(), file=sys.stderr, flush=True)
    mounts.start()
    GROUPS.start()  # ends the attempts' process groups should this process be killed
    ready = {"ready": True, "endpoint": endpoint, "grpcEndpoint": grpc_endpoint, "gcsEndpoint": gcs.endpoint,
             "dataDir": str(data_dir), "pid": os.getpid(),
             "env": {"CLOUD_RUN_EMULATOR_HOST": grpc_endpoint, "STORAGE_EMULATOR_HOST": gcs.endpoint}}
    if proxy is not None:
        ready["googleEndpointEnv"] = google_endpoint.client_env(proxy, identity[2])
    gcs.start()
    if config.preemptions is not None:
        state.schedule.start(config.preemptions)
    threading.Thread(target=_announce, args=(server, ready), daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        if proxy is not None:
            proxy.stop()
        rpc_server.stop(0.5)
        state.schedule.stop()
        registry.shutdown(config.shutdown_grace_seconds)
        GROUPS.close()
        mounts.stop()
        gcs.stop()
        sys.stdout.flush()

"""The gRPC server: the same API methods as the REST app, for the clients' default transport.

It serves ``google.cloud.run.v2.Jobs``, ``Executions`` and ``Tasks`` and
``google.longrunning.Operations`` (which the clients' ``operation.result()`` polls with
GetOperation, and their ``wait_operation`` calls) on its own port of 127.0.0.1, in the REST
server's process, over the same backends: every method is :data:`~.rpcs.RPCS`' handler run by
:func:`~.rpcs.call`, so the request quota and counters, validation, injected faults and errors
are the REST side's. An :class:`~.exceptions.EmulatorError` ends the call with its gRPC code
(``grpc_code``) and its message, the same code and message the REST side puts in its JSON error,
and with its details (a quota error's ``ErrorInfo``) in a ``google.rpc.Status`` in the
``grpc-status-details-bin`` trailer, as Google's servers send them (see :func:`status_details`).
It also serves Cloud Build and Artifact Registry (:mod:`.cloud_build`, :mod:`.artifact_registry`)
over the same lock and operations, outside Cloud Run's request quota and injected faults.

Why grpcio's generic handlers and no generated code: ``google-cloud-run`` ships the message
classes but no servicer base classes, and generating them would take vendored ``.proto`` files
and ``grpcio-tools``. A :func:`grpc.method_handlers_generic_handler` per service needs neither:
requests are read with the method's own request class (``run_v2.CreateJobRequest.deserialize``
for the proto-plus Cloud Run types the backend takes, ``FromString`` for the plain protobuf
``google.longrunning`` ones), and each handler answers with bytes it serialized under the
registry's lock (no response serializer), so an answer never mixes two states, as on REST.

Exposure. It binds 127.0.0.1 only and speaks gRPC only: HTTP/2 without TLS, which a client must
open with the HTTP/2 connection preface. A browser never speaks that: it uses HTTP/2 only over
TLS, and a web page's requests (``fetch``, forms, images, DNS-rebound names alike) reach this port
as HTTP/1.1, whose first line cannot be the preface, so the server drops the connection before
any method runs. A page can therefore neither call a method nor read an answer, and the REST
side's ``Host``/``Origin``/``Content-Type`` checks have no counterpart here. Like the REST side it
takes no token: whoever can open a loopback connection may use either. The largest request it
reads is the REST side's :data:`~.guards.MAX_BODY_BYTES` (gRPC's default; larger ones get
RESOURCE_EXHAUSTED from grpcio).
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable, Optional, Sequence

import grpc
from google.rpc import status_pb2

from . import rpcs
from .backend import Registry
from .exceptions import EmulatorError
from .faults import ApiFaults
from .guards import MAX_BODY_BYTES
from .quota import QuotaSettings, RequestQuota

#: Methods running at once (a WaitOperation holds one while it waits); the REST app's thread
#: pool has as many.
MAX_WORKERS = 40
_CODES = {code.value[0]: code for code in grpc.StatusCode}
#: The trailer that carries a ``google.rpc.Status`` with an error's details (what grpcio-status's
#: ``rpc_status`` reads on the client side, and google-api-core with it).
STATUS_DETAILS_KEY = "grpc-status-details-bin"


def to_bytes(message) -> bytes:
    """The wire form of a proto-plus or plain protobuf message."""
    if hasattr(message, "SerializeToString"):
        return message.SerializeToString()
    return type(message).serialize(message)


def request_reader(cls: type) -> Callable[[bytes], object]:
    """How to read a request of ``cls``: proto-plus ``deserialize`` or protobuf ``FromString``."""
    return cls.FromString if hasattr(cls, "FromString") else cls.deserialize


def status_of(err: EmulatorError) -> grpc.StatusCode:
    """The gRPC status code of an emulator error (``INTERNAL`` for an unknown number)."""
    return _CODES.get(err.grpc_code, grpc.StatusCode.INTERNAL)


def status_details(err: EmulatorError) -> Optional[bytes]:
    """The ``google.rpc.Status`` (code, message, details) of an error with details, serialized
    for the :data:`STATUS_DETAILS_KEY` trailer; ``None`` for an error without details."""
    if not err.details:
        return None
    return status_pb2.Status(code=err.grpc_code, message=err.message,
                             details=err.packed_details()).SerializeToString()


def _method(registry: Registry, faults: ApiFaults, quota: RequestQuota, rpc: rpcs.Rpc) -> grpc.RpcMethodHandler:
    def run(request, context: grpc.ServicerContext) -> bytes:
        try:
            return rpcs.call(registry, faults, quota, rpc, request, to_bytes)
        except EmulatorError as err:
            error = err
        except Exception as exc:  # an emulator bug: still a status the client maps
            error = rpcs.internal_error(exc)
        details = status_details(error)
        if details is not None:
            context.set_trailing_metadata(((STATUS_DETAILS_KEY, details),))
        context.abort(status_of(error), error.message)

    return grpc.unary_unary_rpc_method_handler(run, request_deserializer=request_reader(rpc.request))


def handlers(registry: Registry, faults: ApiFaults, quota: RequestQuota, others: Sequence = ()) -> list:
    """One generic handler per service, with every method of :data:`~.rpcs.RPCS` and ``others``.

    :param others: the other emulated APIs' methods (:class:`~.rpcs.Rpc` entries: Cloud Build's
        and Artifact Registry's, see :func:`~.cloud_build.services`); they are not Cloud Run's, so
        they are charged to no quota and take no injected fault of Cloud Run's.
    """
    services: dict = {}
    for rpc in rpcs.RPCS.values():
        services.setdefault(rpc.service, {})[rpc.method] = _method(registry, faults, quota, rpc)
    unlimited = RequestQuota(QuotaSettings(reads_per_minute=0, writes_per_minute=0))
    for rpc in others:
        services.setdefault(rpc.service, {})[rpc.method] = _method(registry, ApiFaults(), unlimited, rpc)
    return [grpc.method_handlers_generic_handler(service, methods) for service, methods in services.items()]


def start(registry: Registry, faults: ApiFaults, quota: RequestQuota, port: int = 0,
          tls: Optional[tuple] = None, others: Sequence = ()) -> tuple:
    """Start the gRPC server on ``127.0.0.1:port``, and on a second, TLS port when asked.

    :param registry: the backends the REST app serves too.
    :param faults: the REST app's fault injector (faults apply to both transports).
    :param quota: the REST app's request quota and counters (one for both transports).
    :param port: the port; 0 picks a free one.
    :param tls: ``(private_key_pem, certificate_chain_pem)`` to serve the same methods over TLS on
        a free port too (see :mod:`.google_endpoint`), or ``None`` (default).
    :param others: other emulated APIs' methods to serve too (see :func:`handlers`).
    :return: ``(server, "127.0.0.1:PORT", tls_port)``, ``tls_port`` being ``None`` without
        ``tls``; stop it with ``server.stop(grace)``.
    :raises RuntimeError: when the port cannot be bound (in use: grpcio's port sharing is off).
    """
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="grpc"),
        handlers=handlers(registry, faults, quota, others),
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_BODY_BYTES)],
    )
    try:
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
    except RuntimeError as exc:  # grpcio raises when it cannot bind
        raise RuntimeError(f"gRPC port 127.0.0.1:{port} cannot be bound: {exc}") from None
    if not bound:
        raise RuntimeError(f"gRPC port 127.0.0.1:{port} cannot be bound (in use?)")
    tls_port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([tls])) if tls else None
    server.start()
    return server, f"127.0.0.1:{bound}", tls_port

"""Stand in for Google's own Cloud Run endpoint, for clients that cannot be pointed anywhere else.

Some code builds its Cloud Run clients with no way to change the endpoint or to get an insecure
channel: the Airflow google provider's ``CloudRunHook`` (and so its operators and trigger) opens
a TLS channel to ``run.googleapis.com:443`` (or ``{region}-run.googleapis.com:443``). With
``serve --google-endpoint`` such a process reaches the emulator through environment variables
that gRPC itself reads, with no code change:

- ``grpc_proxy=http://127.0.0.1:PORT``: gRPC opens every channel through this HTTP ``CONNECT``
  proxy (:class:`ConnectProxy`), which leads a ``CONNECT`` to a Cloud Run host on port 443 (or
  a Cloud Build or Artifact Registry one: the emulator serves them too, see :mod:`.cloud_build`)
  to the emulator's TLS gRPC port and refuses any other target (403), so other Google APIs fail
  at once instead of reaching the wrong server.
- ``no_grpc_proxy=127.0.0.1,localhost``: channels to loopback addresses (``CLOUD_RUN_EMULATOR_HOST``)
  stay direct.
- ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH=DATA_DIR/google-tls/ca.pem``: gRPC trusts the certificate
  authority the emulator made at start (:func:`make_identity`), which signed the emulator's
  certificate for ``run.googleapis.com`` and ``*.googleapis.com``; that file replaces the
  process's trusted roots, so such a process can reach no real Google service over gRPC.

gRPC reads both when it is first imported, so they must be in the process's environment from its
start (the ready line's ``googleEndpointEnv``, :attr:`~.process.EmulatorProcess.google_endpoint_env`,
made by :func:`client_env`).
Google-auth is not involved: the process still needs anonymous credentials (a connection with
``is_anonymous``). The CA's private key is never written; the server's key lives only in memory.

Exposure: the proxy listens on 127.0.0.1 and speaks HTTP/1.1, so a browser page can reach it, but
it answers nothing except ``CONNECT``, a method no page can send (``fetch`` and XHR forbid it,
forms cannot use it); every other request gets 405 and a closed connection, having reached no
method. The TLS port speaks gRPC only, as the insecure one does (see :mod:`.grpc_server`).
"""

from __future__ import annotations

import datetime as dt
import re
import socket
import threading
from pathlib import Path

#: ``CONNECT`` targets led to the emulator: the global and regional endpoints of Cloud Run and of
#: the other APIs it serves on gRPC (Cloud Build, Artifact Registry; see :mod:`.cloud_build`).
CLOUD_RUN_HOST = re.compile(r"^(?:[a-z0-9-]+-)?(?:run|cloudbuild|artifactregistry)\.googleapis\.com:443$")
#: The names the emulator's certificate is for (``*.googleapis.com``: the regional endpoints).
CERTIFICATE_NAMES = ("run.googleapis.com", "*.googleapis.com")
#: Longest ``CONNECT`` request head read (bytes).
MAX_HEAD_BYTES = 8192
_CERTIFICATE_DAYS = 30


def make_identity(folder: Path) -> tuple:
    """A new certificate authority (its certificate written to ``folder/ca.pem``) and a
    certificate it signed for :data:`CERTIFICATE_NAMES`.

    :param folder: where ``ca.pem`` goes (created if missing).
    :return: ``(private_key_pem, certificate_chain_pem, ca_file)`` for
        ``grpc.ssl_server_credentials``.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.timezone.utc)

    def certificate(subject: str, issuer: str, public_key, signer, extensions: list):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(days=_CERTIFICATE_DAYS)))
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = "Cloud Run emulator local CA"
    ca = certificate(ca_name, ca_name, ca_key.public_key(), ca_key,
                     [(x509.BasicConstraints(ca=True, path_length=0), True)])
    names = x509.SubjectAlternativeName([x509.DNSName(name) for name in CERTIFICATE_NAMES])
    leaf = certificate(CERTIFICATE_NAMES[0], ca_name, key.public_key(), ca_key, [(names, False)])
    folder.mkdir(parents=True, exist_ok=True)
    ca_file = folder / "ca.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, leaf.public_bytes(serialization.Encoding.PEM), ca_file


def client_env(proxy: "ConnectProxy", ca_file: Path) -> dict:
    """The environment that leads a new process's gRPC channels for Cloud Run here.

    :param proxy: the running proxy.
    :param ca_file: the CA certificate :func:`make_identity` wrote.
    :return: ``grpc_proxy``, ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``, and ``no_grpc_proxy`` for
        loopback targets (so that the same process may also use ``CLOUD_RUN_EMULATOR_HOST``).
    """
    return {"grpc_proxy": proxy.url, "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(ca_file),
            "no_grpc_proxy": "127.0.0.1,localhost"}


class ConnectProxy:
    """An HTTP ``CONNECT`` proxy on 127.0.0.1 that leads Cloud Run hosts to one local port.

    :param target_port: the emulator's TLS gRPC port on 127.0.0.1.
    :param port: the proxy's port; 0 picks a free one.
    """

    def __init__(self, target_port: int, port: int = 0) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", port))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def start(self) -> "ConnectProxy":
        """Accept connections on a daemon thread; return ``self``."""
        threading.Thread(target=self._accept, name="connect-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop accepting (tunnels already open end with their connections)."""
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed by stop()
                return
            threading.Thread(target=self._serve, args=(conn,), name="connect-tunnel", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = _read_head(conn)
            target = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if len(target) != 3 or target[0] != "CONNECT":
                conn.sendall(b"HTTP/1.1 405 Method Not Allowed\r\nAllow: CONNECT\r\nConnection: close\r\n\r\n")
                return
            if not CLOUD_RUN_HOST.match(target[1]):
                conn.sendall(b"HTTP/1.1 403 Forbidden\r\nConnection: close\r\n\r\n")
                return
            with socket.create_connection(("127.0.0.1", self.target_port)) as upstream:
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                upstream.sendall(head.split(b"\r\n\r\n", 1)[1])  # bytes the client sent early, if any
                back = threading.Thread(target=_pipe, args=(upstream, conn), daemon=True)
                back.start()
                _pipe(conn, upstream)
                back.join()


def _read_head(conn: socket.socket) -> bytes:
    """The request head (and whatever followed it in the same reads), at most :data:`MAX_HEAD_BYTES`."""
    head = b""
    while b"\r\n\r\n" not in head and len(head) < MAX_HEAD_BYTES:
        chunk = conn.recv(4096)
        if not chunk:
            break
        head += chunk
    return head if b"\r\n\r\n" in head else b""


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    """Copy ``source`` to ``sink`` until either ends; then end both directions."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    for sock in (source, sink):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

"""What the emulator accepts, and from whom: request checks for both servers, and path containment.

The emulator runs the command of any job it is given, so it must answer only the local programs
that mean to talk to it, never a web page open in the user's browser. A page can make the browser
send requests to ``127.0.0.1`` (cross-site request forgery), and with DNS rebinding it can even
read the answers, although both servers bind the loopback interface only. The checks, applied
before any handler runs (:class:`GuardMiddleware` for the Admin API, :func:`refusal` for the
GCS emulator too):

- ``Host`` must name a loopback address: ``127.0.0.0/8``, ``localhost`` or ``[::1]``, with or
  without a port (:func:`loopback_host`). A page whose DNS name was rebound to 127.0.0.1 still
  sends its own name.
- ``Origin``, when present, must be the server's own origin (``http://`` plus the ``Host``):
  browsers add ``Origin`` to every cross-origin request except plain navigations (and their GETs
  of images and scripts), and to every same-origin one that is not a GET or HEAD.
- A state-changing request (any method but GET and HEAD) must not carry ``Sec-Fetch-Site:
  cross-site`` or ``same-site`` (sent by current browsers with every request).
- On the Admin API server such a request must also carry ``Content-Type: application/json``: a
  browser sends that type cross-origin only after a CORS preflight (``OPTIONS``), which the
  emulator never approves. The GCS emulator takes uploads of any type, so there a POST only may
  not carry one of the three types a form can send (``text/plain``,
  ``application/x-www-form-urlencoded``, ``multipart/form-data``); its ``GET /wipe`` (delete
  everything, a GET with a side effect) is refused.
- The Admin API reads at most :data:`MAX_BODY_BYTES` of a request body.

The unmodified Google clients pass every check: they send ``Host: 127.0.0.1:PORT``, no
``Origin``, and JSON (Cloud Run; Storage sends JSON, ``multipart/related`` or the object's type).

:func:`contained` is the one check for paths built from request values (volume folders, log
folders): the result must stay inside the folder it was built from.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Iterable, Optional

from starlette.responses import JSONResponse

from .exceptions import EmulatorError, InvalidArgument, PayloadTooLarge, PermissionDenied, UnsupportedMediaType

#: Largest request body the Admin API reads (bytes): gRPC's default limit on a received message.
MAX_BODY_BYTES = 4 * 1024 * 1024
#: An oversized body up to this size (bytes) is read and dropped before the 413 goes out, so that
#: a client still sending it hears the answer; a larger one gets the answer and a closed connection.
DRAIN_BYTES = 64 * 1024 * 1024
SAFE_METHODS = ("GET", "HEAD")
#: The ``Content-Type`` values a page may send cross-origin without a CORS preflight.
FORM_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")

_HOST = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[^:\[\]/@\s]+))(?::(?P<port>[0-9]{1,5}))?$")


class PathEscape(PermissionError):
    """A path built from request values would leave the folder it must stay in."""


def loopback_host(value: Optional[str]) -> bool:
    """Whether a ``Host`` header value names this machine's loopback interface.

    :param value: the header value, e.g. ``127.0.0.1:8123``, ``localhost``, ``[::1]:80``
        (``None`` or empty: no).
    :returns: true for ``127.0.0.0/8`` in dotted-quad form, ``localhost`` (any case) and ``[::1]``,
        each with or without a port; false for everything else, ``0.0.0.0`` and names such as
        ``localhost.example.com`` included.
    """
    found = _HOST.match(value or "")
    if not found:
        return False
    if found.group("v6") is not None:
        try:
            return ipaddress.IPv6Address(found.group("v6")).is_loopback
        except ValueError:
            return False
    name = found.group("name")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.IPv4Address(name).is_loopback
    except ValueError:
        return False


def media_type(content_type: Optional[str]) -> str:
    """The media type of a ``Content-Type`` value, lower case, without parameters (``""``: none)."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def refusal(method: str, headers: dict, json_only: bool) -> Optional[EmulatorError]:
    """Why a request must be refused, or ``None`` when it may be served.

    :param method: the HTTP method, upper case.
    :param headers: lower-case header name -> list of values (a header sent twice has two).
    :param json_only: true on the Admin API (state-changing requests must be JSON); false on the
        GCS emulator (a POST must not carry a form's content type).
    :returns: a :class:`~.exceptions.PermissionDenied` (Host, Origin, Sec-Fetch-Site) or an
        :class:`~.exceptions.UnsupportedMediaType` (Content-Type), naming the header.
    """
    hosts = headers.get("host", [])
    if len(hosts) != 1 or not loopback_host(hosts[0]):
        shown = hosts[0] if len(hosts) == 1 else hosts
        return PermissionDenied(
            f"Host: {shown!r} is not a loopback address; the emulator answers only requests for "
            "127.0.0.0/8, localhost or [::1] (with or without a port).")
    own_origin = f"http://{hosts[0]}".lower()
    for origin in headers.get("origin", []):
        if origin.strip().lower() != own_origin:
            return PermissionDenied(f"Origin: cross-origin requests are refused (got {origin!r}).")
    if method in SAFE_METHODS:
        return None
    for site in headers.get("sec-fetch-site", []):
        if site.strip().lower() in ("cross-site", "same-site"):
            return PermissionDenied(f"Sec-Fetch-Site: requests from other sites are refused (got {site!r}).")
    types = [media_type(value) for value in headers.get("content-type", [])]
    if json_only and types != ["application/json"]:
        return UnsupportedMediaType(
            f"Content-Type: {method} requests must be application/json, got {headers.get('content-type', [])}.")
    if not json_only and method == "POST" and any(t in FORM_TYPES for t in types):
        return UnsupportedMediaType(f"Content-Type: a POST may not carry a form's type, got {types}.")
    return None


def header_lists(pairs: Iterable) -> dict:
    """``{lower-case name: [values]}`` from ``(name, value)`` pairs (bytes or str)."""
    found: dict = {}
    for name, value in pairs:
        name = name.decode("latin-1") if isinstance(name, bytes) else name
        value = value.decode("latin-1") if isinstance(value, bytes) else value
        found.setdefault(name.lower(), []).append(value)
    return found


def contained(base: Path, *parts: str) -> Path:
    """``base`` joined with ``parts``, refused when the result (symbolic links resolved) is not
    ``base`` itself or inside it.

    :param base: the folder the result must stay in (need not exist).
    :param parts: relative path pieces taken from a request (an absolute one is refused too).
    :returns: the joined path, not resolved (as the caller spelled it).
    :raises PathEscape: naming the path, when it would leave ``base``.
    """
    joined = Path(base, *parts)
    root = Path(base).resolve()
    resolved = joined.resolve()
    if resolved != root and root not in resolved.parents:
        raise PathEscape(f"'{joined}' is outside '{base}'.")
    return joined


def climbs_out(relative: str) -> bool:
    """Whether a ``/``-separated path climbs above its starting folder: ``a/../..`` and ``..``
    do, ``a/../b`` does not. Leading slashes are ignored (the path is taken as relative).

    :param relative: the path, e.g. the part of a container path after its mount path.
    """
    depth = 0
    for part in relative.split("/"):
        if part in ("", "."):
            continue
        depth += -1 if part == ".." else 1
        if depth < 0:
            return True
    return False


def under_mount(value: str, mount_path: str) -> Optional[tuple]:
    """Split a container path value at a mount path.

    :param value: an env value, arg or command element; ``-flag=PATH`` is looked at after ``=``.
    :param mount_path: a mount path without a trailing slash, e.g. ``/checkpoints``.
    :returns: ``(head, rest)`` when the path is ``mount_path`` or below it (``head`` is the
        ``-flag=`` part or ``""``, ``rest`` what follows ``mount_path``, ``""`` or ``/...``),
        else ``None``.
    """
    head, sep, path = value.partition("=") if value.startswith("-") else ("", "", value)
    if path == mount_path or path.startswith(mount_path + "/"):
        return head + sep, path[len(mount_path):]
    return None


class GuardMiddleware:
    """ASGI middleware: :func:`refusal` (``json_only``) on every HTTP request, then a body limit;
    a refused request never reaches the application.

    The body is read here, up to ``max_body_bytes``, and handed on to the application whole; an
    oversized one is read and dropped up to :data:`DRAIN_BYTES`, then answered.

    :param app: the ASGI application.
    :param max_body_bytes: largest body accepted (bytes, default :data:`MAX_BODY_BYTES`); a larger
        one is answered 413 RESOURCE_EXHAUSTED in Google's error shape.
    """

    def __init__(self, app, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = header_lists(scope["headers"])
        problem = refusal(scope["method"], headers, json_only=True)
        if problem is not None:
            await _answer(problem, scope, receive, send)
            return
        declared = self._declared_length(headers.get("content-length", []))
        if isinstance(declared, EmulatorError):
            await _answer(declared, scope, receive, send)
            return
        if declared is not None and declared > DRAIN_BYTES:
            await _answer(self._too_large(), scope, receive, send)  # not worth reading: close
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            size += len(message.get("body", b""))
            if size <= self.max_body_bytes:
                chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
            if size > self.max_body_bytes and (not more or size > DRAIN_BYTES):
                # read (and drop) an oversized body first, so the client, still sending, hears the 413
                await _answer(self._too_large(), scope, receive, send)
                return
            if not more:
                break
        body = b"".join(chunks)
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()  # later messages: http.disconnect
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    @staticmethod
    def _declared_length(lengths: list):
        """The ``Content-Length`` (``None``: not sent), or the error for a malformed one."""
        if not lengths:
            return None
        try:
            return int(lengths[0])
        except ValueError:
            return InvalidArgument(f"Content-Length: not a number ({lengths[0]!r}).")

    def _too_large(self) -> EmulatorError:
        return PayloadTooLarge(f"Request payload size exceeds the limit: {self.max_body_bytes} bytes.")


async def _answer(error: EmulatorError, scope, receive, send) -> None:
    response = JSONResponse(status_code=error.http_code, content=error.to_dict(), headers={"Connection": "close"})
    await response(scope, receive, send)

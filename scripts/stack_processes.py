"""The processes of the local Airflow stack (:mod:`airflow_stack`): each in a process group of
its own with its log file, stopped as a group, its CPU time readable; a free loopback port,
PostgreSQL's binaries, and one JSON request.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Optional


class StackError(RuntimeError):
    """A part of the stack did not start or become healthy; the message names it and its log."""


def free_port() -> int:
    """:return: a TCP port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_pg_bin() -> Path:
    """:return: the folder with PostgreSQL's ``initdb`` and ``postgres`` (``$PG_BIN``, or the
    newest ``/usr/lib/postgresql/<version>/bin``).

    :raises StackError: none is installed; the message says how to install it.
    """
    if os.environ.get("PG_BIN"):
        return Path(os.environ["PG_BIN"])
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name)
                   if p.parent.parent.name.isdigit() else 0)
    if found:
        return found[-1].parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    raise StackError("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb, no initdb on PATH): "
                     "`apt-get install -y postgresql` (scripts/system_packages.sh does this as root), or set PG_BIN")


class _Proc:
    """One started process: its own process group, its log file."""

    def __init__(self, name: str, argv: list[str], env: dict, log_path: Path, user: Optional[str] = None,
                 cwd: Optional[Path] = None) -> None:
        self.name, self.log_path = name, log_path
        with log_path.open("ab") as log:
            kwargs = {}
            if user is not None:
                entry = pwd.getpwnam(user)
                kwargs = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
            self.popen = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd, **kwargs)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the whole process group (no-op once it has ended)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signum)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the group, wait up to ``timeout`` s, then SIGKILL the group; reap."""
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # whatever is left of the group (children of a dead leader, too)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)

    def cpu_seconds(self) -> float:
        """User and system CPU seconds of the group's leader and its live descendants so far,
        with the children each has reaped (0.0 once the leader has ended)."""
        import psutil

        try:
            leader = psutil.Process(self.popen.pid)
            processes = [leader, *leader.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                times = process.cpu_times()
                total += times.user + times.system + times.children_user + times.children_system
        return total

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _http_json(url: str, payload: Optional[dict] = None, timeout: float = 5.0, token: Optional[str] = None) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())

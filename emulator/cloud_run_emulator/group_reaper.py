"""Every process of a task attempt ends with the emulator, however the emulator ends.

An attempt runs in a process group of its own, and its first process gets the parent-death
signal (see :func:`.runtime._spawn_args`): a hard-killed emulator takes that process along, but
not the processes it started, which init adopts and which would run on. A container's processes
all end with it, so the emulator keeps one helper process, :func:`main`, started with the server
(or the first attempt, :data:`GROUPS`):

- it runs in a session of its own, so that a signal to the emulator's process group (a
  terminal's Ctrl-C, ``kill -- -PGID``) does not end it with the emulator;
- it reads the attempts' process group ids from a pipe: ``+PGID`` when an attempt has started,
  ``-PGID`` once the emulator has SIGKILLed what was left of its group and reaped its first
  process (:meth:`GroupReaper.forget`);
- at the pipe's end of file, which comes when the emulator's process has ended by any means (the
  kernel closes its end of the pipe; no other process holds it: descriptors are not inherited)
  or called :meth:`GroupReaper.close`, it SIGKILLs every group it still holds, then exits.

A group id is not reused while a process of the group lives (the kernel keeps the id
allocated), and the emulator forgets a group only after its SIGKILL to it, so the helper's
SIGKILL reaches no one else's processes. Limits: a process that leaves its group (``setsid``,
``setpgid``) escapes, as it escapes the emulator's own stop; and a process that an attempt
started in the moment between its ``Popen`` and its ``+PGID`` line, just as the emulator was
hard-killed, would run on (its first process dies by the parent-death signal). Without the
helper (it could not start, or was killed), attempts still stop as before, through the
parent-death signal; the first failure is reported once on stderr.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Optional


class GroupReaper:
    """The emulator's side: starts the helper with the first :meth:`watch` and tells it which
    process groups are the attempts'. Thread-safe (supervisors start and reap attempts in
    threads of their own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._helper: Optional[subprocess.Popen] = None
        self._broken = False

    def start(self) -> None:
        """Start the helper now (the server does, before its ready line) rather than with the
        first :meth:`watch`; nothing when it runs already."""
        self._send("")

    def watch(self, pgid: int) -> None:
        """An attempt's process group has started: SIGKILL it if the emulator dies.

        :param pgid: the group's id (the attempt's first process's pid).
        """
        self._send(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        """The emulator has SIGKILLed the group and reaped its first process: leave it alone.

        :param pgid: as given to :meth:`watch`.
        """
        self._send(f"-{pgid}\n")

    def close(self, timeout: float = 5.0) -> None:
        """End the helper (the groups it still holds get SIGKILL) and reap it; a later
        :meth:`watch` starts a new one.

        :param timeout: seconds to wait for it before it is killed.
        """
        with self._lock:
            helper, self._helper = self._helper, None
        if helper is None:
            return
        helper.stdin.close()
        try:
            helper.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait()

    def _send(self, line: str) -> None:
        with self._lock:
            if self._broken:
                return
            try:
                if self._helper is None:
                    self._helper = subprocess.Popen(
                        [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                        start_new_session=True)
                if line:
                    self._helper.stdin.write(line.encode())
                    self._helper.stdin.flush()
            except OSError as exc:  # no interpreter to start, or the helper is gone (a broken pipe)
                self._broken = True
                print(f"cloud_run_emulator: the attempts' group reaper failed ({exc}); a hard-killed emulator "
                      f"may leave the processes that tasks started running", file=sys.stderr, flush=True)


#: This emulator process's reaper: :func:`.runtime.launch` watches each attempt's group,
#: :meth:`.runtime.Attempt.close` forgets it, and the server closes it at its end.
GROUPS = GroupReaper()


def main() -> int:
    """The helper: read ``+PGID`` / ``-PGID`` lines from stdin until its end, then SIGKILL the
    groups still held. :return: 0."""
    groups: set = set()
    for line in sys.stdin.buffer:
        if line[:1] == b"+":
            groups.add(int(line[1:]))
        elif line[:1] == b"-":
            groups.discard(int(line[1:]))
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # ended meanwhile
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

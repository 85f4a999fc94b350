"""The machine's side of the FUSE volume: whether a FUSE mount can work here, the kernel's mount
table, and lazy unmounts (``fusermount3 -u -z``).

Imported by the emulator (:mod:`.gcsfuse`) and by the mount process (:mod:`.gcsfuse_process`);
it imports no FUSE library (``mfusepy`` would search for libfuse with ``ldconfig`` at import).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


def fuse_available() -> tuple:
    """``(True, "")`` when a FUSE mount can work here, else ``(False, reason)``: not Linux, no
    ``/dev/fuse``, no ``fusermount3``, or ``mfusepy``/libfuse3 not importable."""
    if not sys.platform.startswith("linux"):
        return False, f"not Linux ({sys.platform})"
    if not os.path.exists("/dev/fuse"):
        return False, "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return False, "no fusermount3 (Debian package fuse3)"
    import ctypes
    import importlib.util

    if importlib.util.find_spec("mfusepy") is None:
        return False, "mfusepy is not installed (a requirement of the cloud-run-emulator distribution)"
    try:  # dlopen by soname: importing mfusepy would search for it with ldconfig (slow)
        ctypes.CDLL("libfuse3.so.3")
    except OSError as exc:
        return False, f"libfuse3 missing ({exc}; Debian package libfuse3-3)"
    return True, ""


def _unescape(field: str) -> str:
    """A path field of ``/proc/self/mounts``: the kernel writes space, tab, newline and backslash
    as octal escapes (``\\040``, ``\\011``, ``\\012``, ``\\134``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mount_points(fs_prefix: str = "") -> list:
    """Mount points (unescaped) of ``/proc/self/mounts`` whose file system type starts with ``fs_prefix``."""
    with open("/proc/self/mounts") as mounts:
        return [_unescape(parts[1]) for parts in (line.split() for line in mounts)
                if len(parts) > 2 and parts[2].startswith(fs_prefix)]


def is_mounted(path: str) -> bool:
    """Whether ``path`` (absolute, resolved) is a mount point, from the kernel's mount table
    (``os.path.ismount`` where that cannot be read)."""
    try:
        return path in _mount_points()
    except OSError:
        return os.path.ismount(path)


def fusermount_lazy(path) -> None:
    """``fusermount3 -u -z path``, quietly, whether or not it is mounted."""
    subprocess.run(["fusermount3", "-u", "-z", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=False)


def lazy_unmount(path) -> None:
    """``fusermount3 -u -z path`` (quietly; nothing when it is not mounted)."""
    path = str(path)
    if is_mounted(path):
        fusermount_lazy(path)


def unmount_stale(under) -> list:
    """Lazily unmount every FUSE mount below folder ``under`` (left by a hard-killed run).

    :returns: the mount points unmounted.
    """
    prefix = str(Path(under).resolve()).rstrip("/") + "/"
    try:
        found = [point for point in _mount_points("fuse") if point.startswith(prefix)]
    except OSError:
        return []
    for point in found:
        lazy_unmount(point)
    return found

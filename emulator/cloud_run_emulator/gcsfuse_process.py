"""The FUSE volume's mount process: ``python -m cloud_run_emulator.gcsfuse_process
--source DIR --mountpoint DIR --state-dir DIR [--strict] [--buckets-root] [--option K=V]...``.

:class:`~.gcsfuse.GcsFuseMount` starts it; it serves :class:`~.gcsfuse_ops.GcsFuseOperations`
(gcsfuse's ``docs/semantics.md``, as the module docstring of :mod:`.gcsfuse` lists it) at the
mount point until SIGTERM, or until its parent process dies (even by SIGKILL), then unmounts.
Only this process imports ``mfusepy`` and the file system's modules.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import sys
import threading
import time

import mfusepy

from cloud_run_emulator.mount_options import parse_mount_options

from .gcsfuse_host import fusermount_lazy
from .gcsfuse_ops import GcsFuseOperations
from .gcsfuse_rules import MountSettings


def _buffer(buf, size: int) -> memoryview:
    """The kernel's buffer at ``buf`` (``size`` bytes) as a writable byte view, without a copy."""
    view = (ctypes.c_char * size).from_address(ctypes.cast(buf, ctypes.c_void_p).value)
    return memoryview(view).cast("B")


class FastFUSE(mfusepy.FUSE):
    """An ``mfusepy.FUSE`` whose read and write move bytes between the kernel's buffer and the
    files without a Python ``bytes`` copy per call, whose truncate gets the file handle, and
    which refuses ``renameat2`` flags (``EINVAL``) rather than ignore them."""

    def read(self, path, buf, size, offset, fip):
        return self.operations.read_into(fip.contents.fh, _buffer(buf, size), size, offset)

    def write(self, path, buf, size, offset, fip):
        return self.operations.write_from(fip.contents.fh, _buffer(buf, size), offset)

    def truncate_fuse_3(self, path, length, fip):
        # mfusepy drops the handle; ftruncate must cut the file of the handle it names
        fh = fip.contents.fh if fip else None
        return self.operations.truncate(None if path is None else path.decode(self.encoding, self.errors),
                                        length, fh)

    def rename_fuse_3(self, old, new, flags):
        # mfusepy drops renameat2's flags (an exchange became a plain rename, losing a file);
        # gcsfuse supports none of them
        if flags:
            return -errno.EINVAL
        return self.rename_fuse_2(old, new)


def _watch_parent(mountpoint: str) -> None:
    """Unmount when the parent process dies (the emulator hard-killed), which ends the loop."""
    parent = os.getppid()
    while True:
        time.sleep(0.2)
        if os.getppid() != parent:
            fusermount_lazy(mountpoint)
            time.sleep(1.0)
            os._exit(0)


def main(argv=None) -> int:
    """Mount and serve until stopped (see the module docstring); returns 0.

    :param argv: the arguments (``sys.argv[1:]`` when ``None``).
    :raises SystemExit: for bad arguments.
    :raises ValueError: for a bad ``--option`` (see :func:`~cloud_run_emulator.mount_options.parse_mount_options`).
    """
    parser = argparse.ArgumentParser(prog="python -m cloud_run_emulator.gcsfuse_process")
    parser.add_argument("--source", required=True)
    parser.add_argument("--mountpoint", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--buckets-root", action="store_true")
    parser.add_argument("--option", action="append", default=[])
    args = parser.parse_args(argv)
    options = parse_mount_options(args.option, "--option", emulator=True)
    settings = MountSettings.from_options(options, args.strict, args.buckets_root, os.getuid(), os.getgid())
    os.makedirs(os.path.join(args.state_dir, "staging"), exist_ok=True)
    threading.Thread(target=_watch_parent, args=(args.mountpoint,), daemon=True).start()
    ops = GcsFuseOperations(args.source, args.state_dir, settings)
    try:
        FastFUSE(ops, args.mountpoint, foreground=True, fsname="gcsfuse-emulator", allow_other=os.getuid() == 0)
    except RuntimeError as exc:  # libfuse's loop ends with a code after SIGTERM: a normal stop
        print(f"gcsfuse: loop ended ({exc})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The FUSE volume's pure rules (:mod:`cloud_run_emulator.gcsfuse_rules`), table by
table: mount settings from options, which write streams or is staged and why, what a close
uploads, rewrite throttling, ``utimens`` times, the folder-rename limit and attributes. The mount
itself (these rules through a real FUSE mount) is ``tests/emulator/test_gcsfuse.py``.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from cloud_run_emulator.gcsfuse_rules import (
    AFTER_CLOSE, AFTER_RENAME, DEFAULT_STREAMING_FILES, REWRITE_INTERVAL_S, UTIME_NOW, UTIME_OMIT, MountSettings,
    after_upload_cause, attributes, overwrites, rename_dir_refusal, resolve_times, shows_local_copy,
    stream_refusal, throttled, truncation_stages, uploads_at_close,
)
from cloud_run_emulator.mount_options import parse_mount_options


@pytest.mark.parametrize("options, strict, expected", [
    ([], False, dict(strict=False, streaming=True, stream_limit=DEFAULT_STREAMING_FILES, rename_dir_limit=0,
                     file_mode=0o644, dir_mode=0o755, uid=1000, gid=100)),
    (["x-emulator-strict"], False, dict(strict=True)),
    ([], True, dict(strict=True)),
    (["enable-streaming-writes=false"], False, dict(streaming=False)),
    (["write-global-max-blocks=-1"], False, dict(stream_limit=float("inf"))),
    (["write-global-max-blocks=0"], False, dict(stream_limit=0)),
    (["rename-dir-limit=7", "file-mode=600", "dir-mode=700"], False,
     dict(rename_dir_limit=7, file_mode=0o600, dir_mode=0o700)),
    (["uid=5", "gid=6"], False, dict(uid=5, gid=6)),
    (["uid=-1", "gid=-1"], False, dict(uid=1000, gid=100)),
    (["uid=0", "gid=0"], False, dict(uid=0, gid=0)),
])
def test_settings_from_options(options, strict, expected):
    parsed = parse_mount_options(options, "options", emulator=True)
    settings = MountSettings.from_options(parsed, strict, buckets_root=True, uid=1000, gid=100)
    assert settings.buckets_root is True
    for name, value in expected.items():
        assert getattr(settings, name) == value, name


@pytest.mark.parametrize("mode, dirty, opened_existing, local", [
    (None, False, True, False),  # an existing object opened for writing, nothing done: the object
    (None, True, True, True),
    (None, False, False, True),  # a new file
    ("stream", False, True, True),
    ("staged", False, True, True),
])
def test_shows_local_copy(mode, dirty, opened_existing, local):
    assert shows_local_copy(mode, dirty, opened_existing) is local


@pytest.mark.parametrize("opened_existing, base_size, staged", [
    (False, None, False),  # a new file streams
    (False, 5, False),  # a new file over another task's object not uploaded yet
    (True, 0, False),  # an empty object streams (gcsfuse)
    (True, 5, True),
    (True, None, True),  # opened an object deleted since: a rewrite all the same
])
def test_overwrites(opened_existing, base_size, staged):
    assert overwrites(opened_existing, base_size) is staged


@pytest.mark.parametrize("streaming, now, limit, offset, cause", [
    (True, 0, 4, 0, None),
    (True, 3, 4, 0, None),
    (True, 4, 4, 0, "streaming-limit"),
    (True, 0, 0, 0, "streaming-limit"),
    (True, 10**6, float("inf"), 0, None),
    (True, 0, 4, 1, "out-of-order-write"),
    (False, 0, 4, 0, "streaming-disabled"),  # the first reason wins
    (False, 4, 4, 1, "streaming-disabled"),
    (True, 4, 4, 1, "streaming-limit"),
])
def test_stream_refusal(streaming, now, limit, offset, cause):
    assert stream_refusal(streaming, now, limit, offset) == cause


@pytest.mark.parametrize("cause, expected", [
    (None, AFTER_CLOSE), ("overwrite", AFTER_CLOSE), (AFTER_CLOSE, AFTER_CLOSE), (AFTER_RENAME, AFTER_RENAME),
])
def test_after_upload_cause(cause, expected):
    assert after_upload_cause(cause) == expected


@pytest.mark.parametrize("mode, opened_existing, size, length, staged", [
    ("stream", False, 3, 10, False),  # extending a stream only sets its size
    (None, False, 0, 10, False),  # so does extending a new file
    ("stream", False, 10, 3, True),  # cutting a stream stages it
    (None, True, 5, 10, True),  # extending an existing object rewrites it
    (None, True, 5, 0, True),
    ("staged", True, 5, 1, False),  # already staged
    ("staged", False, 5, 10, False),
])
def test_truncation_stages(mode, opened_existing, size, length, staged):
    assert truncation_stages(mode, opened_existing, size, length) is staged


@pytest.mark.parametrize("mode, opened_existing, dirty, unlinked, uploads", [
    (None, False, False, False, True),  # a new file never written: an empty object
    (None, True, False, False, False),  # an existing object, nothing written
    ("stream", False, True, False, True),
    ("staged", True, True, False, True),
    ("staged", True, False, False, False),  # uploaded by fsync, nothing since
    ("stream", False, True, True, False),  # deleted by its task
    (None, False, False, True, False),
])
def test_uploads_at_close(mode, opened_existing, dirty, unlinked, uploads):
    assert uploads_at_close(mode, opened_existing, dirty, unlinked) is uploads


@pytest.mark.parametrize("last, now, expected", [
    (None, 5.0, False),
    (5.0, 5.0, True),
    (5.0, 5.0 + REWRITE_INTERVAL_S / 2, True),
    (5.0, 5.0 + REWRITE_INTERVAL_S, False),
    (5.0, 9.0, False),
])
def test_throttled(last, now, expected):
    assert throttled(last, now) is expected


@pytest.mark.parametrize("given, expected", [
    (None, (99, 99)),
    ((UTIME_NOW, UTIME_NOW), (99, 99)),
    ((UTIME_OMIT, UTIME_NOW), (10, 99)),
    ((UTIME_NOW, UTIME_OMIT), (99, 20)),
    ((1, 2), (1, 2)),
    ((UTIME_OMIT, UTIME_OMIT), (10, 20)),
])
def test_resolve_times(given, expected):
    assert resolve_times(given, (10, 20), now_ns=99) == expected


@pytest.mark.parametrize("objects, limit, refusal", [
    (0, 0, None),
    (1, 0, "EMFILE: 1 objects > rename-dir-limit 0"),
    (10, 10, None),
    (11, 10, "EMFILE: 11 objects > rename-dir-limit 10"),
])
def test_rename_dir_refusal(objects, limit, refusal):
    assert rename_dir_refusal(objects, limit) == refusal


@pytest.mark.parametrize("kind, expected_mode, nlink", [
    (stat.S_IFREG, stat.S_IFREG | 0o600, 1),
    (stat.S_IFDIR, stat.S_IFDIR | 0o700, 2),
])
def test_attributes(kind, expected_mode, nlink):
    st = os.stat_result((kind | 0o777, 11, 0, 9, 0, 0, 513, 1, 2, 3), {"st_mtime_ns": 2_000})
    settings = MountSettings(file_mode=0o600, dir_mode=0o700, uid=7, gid=8)
    got = attributes(st, settings)
    assert got == {"st_mode": expected_mode, "st_nlink": nlink, "st_size": 513, "st_uid": 7, "st_gid": 8,
                   "st_atime": 2_000, "st_mtime": 2_000, "st_ctime": 2_000, "st_blksize": 1 << 20, "st_blocks": 2}


def test_the_emulator_side_imports_no_fuse_library():
    """The modules the emulator imports (the mounts, their records, these rules) load no
    ``mfusepy``: only the mount process (``gcsfuse_process``) does."""
    code = ("import sys; import cloud_run_emulator.server, cloud_run_emulator.gcsfuse, "
            "cloud_run_emulator.gcsfuse_rules; print('mfusepy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"

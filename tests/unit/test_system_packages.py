"""scripts/system_packages.sh: how it calls apt-get when a package is missing.

apt-get is replaced by a stand-in on PATH that refuses, as apt does, when another package manager
holds the lock and the call does not ask to wait for it; `id` says root. Nothing is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "system_packages.sh"

FAKE_APT = """#!/bin/sh
echo "$@" >> "{calls}"
case "$*" in
  *DPkg::Lock::Timeout=*) exit 0 ;;
esac
echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 1 (apt-get)" >&2
exit 100
"""


@pytest.fixture
def fake_path(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A PATH with the stand-in apt-get, an `id` that says root, and grep/ldconfig; no fusermount3."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-calls.txt"
    (bin_dir / "apt-get").write_text(FAKE_APT.format(calls=calls))
    (bin_dir / "id").write_text("#!/bin/sh\necho 0\n")
    for tool in ("apt-get", "id"):
        (bin_dir / tool).chmod(0o755)
    for tool in ("grep", "ldconfig"):
        found = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")
        if found:
            (bin_dir / tool).symlink_to(found)
    env = {k: v for k, v in os.environ.items() if k != "APT_LOCK_TIMEOUT"}
    env["PATH"] = str(bin_dir)
    return env, calls


def run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("bash"), str(SCRIPT), "fuse"], env=env, capture_output=True,
                          text=True, timeout=60)


def test_a_held_apt_lock_is_waited_for_within_a_bound(fake_path):
    env, calls = fake_path
    result = run(env)
    assert result.returncode == 0, result.stderr
    assert "installing fuse3" in result.stdout
    assert all("-o DPkg::Lock::Timeout=600" in line for line in calls.read_text().splitlines())
    env["APT_LOCK_TIMEOUT"] = "30"
    assert run(env).returncode == 0
    assert calls.read_text().splitlines()[-1].startswith("-q -o DPkg::Lock::Timeout=30 install -y")


def test_a_bad_lock_timeout_is_one_clear_error_before_apt_runs(fake_path):
    env, calls = fake_path
    env["APT_LOCK_TIMEOUT"] = "ten"
    result = run(env)
    assert result.returncode == 2
    assert "APT_LOCK_TIMEOUT=ten: use a whole number of seconds" in result.stderr
    assert not calls.exists()

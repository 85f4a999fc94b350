"""``scripts/demo.py``'s arguments: one clear error naming the option, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--checkpoint-every", "0"], "--checkpoint-every must be at least 1, got 0"),
        (["--step-delay", "-1"], "--step-delay must be 0 or more seconds, got -1"),
        (["--hidden", "0"], "--hidden must be at least 1, got 0"),
        (["--grace-seconds", "-5"], "--grace-seconds must be more than 0"),
        (["--grace-seconds", "nan"], "--grace-seconds must be more than 0"),
        (["--preemptions", "-1"], "--preemptions must be in 0..11"),
        (["--preemptions", "12"], "--preemptions must be in 0..11"),
        (["--steps", "100", "--checkpoint-every", "50", "--preemptions", "2"], "--preemptions must be in 0..1"),
        (["--workdir", "/proc/nope"], "--workdir /proc/nope is not a writable folder"),
    ],
)
def test_a_bad_argument_is_one_error_naming_it_and_nothing_starts(args, message, tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "demo.py"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""  # no emulator, no Airflow: nothing was printed, so nothing started

"""``TESTS_REQUIRE_FULL_ENV`` (``tests/conftest.py``): what a laptop may lack skips a test (or
lets it fall back to plain folders) when the switch is unset, and fails it, naming what is
missing and how to install it, under ``TESTS_REQUIRE_FULL_ENV=1``; any other value is refused.

Each case is a real pytest run in a subprocess on a probe module, with ``tests/conftest.py``
loaded as a plugin and a ``PATH`` without ``fusermount3``, so FUSE is really unavailable there.
Cost: about 10 s on two loaded cores (four pytest processes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = '''
from tests.conftest import require_fuse, require_module


def test_extra():
    require_module("agr_no_such_module", extra="lightning")


def test_fuse_fixture(fuse):
    pass


def test_fuse_fallback():
    assert require_fuse(fallback=True) is False
'''


def _run(tmp_path: Path, value: str | None) -> tuple[subprocess.CompletedProcess, dict[str, tuple[str, str]]]:
    """Run the probe with ``TESTS_REQUIRE_FULL_ENV`` set to ``value`` (``None``: unset).

    :returns: the process and ``{test: (outcome, message)}`` from its JUnit XML.
    """
    (tmp_path / "test_probe.py").write_text(PROBE)
    no_fuse = tmp_path / "bin"
    no_fuse.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TESTS_REQUIRE_FULL_ENV"}
    env.update(PATH=str(no_fuse), PYTHONPATH=str(REPO))
    if value is not None:
        env["TESTS_REQUIRE_FULL_ENV"] = value
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
         "--rootdir", str(tmp_path), f"--junitxml={report}", str(tmp_path / "test_probe.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    outcomes = {}
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            found = [(child.tag, child.get("message", "")) for child in case if child.tag in ("skipped", "failure", "error")]
            outcomes[case.get("name")] = found[0] if found else ("passed", "")
    return proc, outcomes


def test_unset_skips_or_falls_back_and_says_how_to_install(tmp_path: Path) -> None:
    proc, outcomes = _run(tmp_path, None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert outcomes["test_fuse_fallback"] == ("passed", "")
    kind, message = outcomes["test_extra"]
    assert kind == "skipped" and "agr_no_such_module is not importable" in message
    assert "make venv (installs ./worker[lightning])" in message
    kind, message = outcomes["test_fuse_fixture"]
    assert kind == "skipped" and "FUSE is unavailable (" in message
    assert "scripts/system_packages.sh fuse" in message and "make venv" in message


def test_one_fails_each_with_what_is_missing_and_how_to_install(tmp_path: Path) -> None:
    proc, outcomes = _run(tmp_path, "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert {name: kind for name, (kind, _) in outcomes.items()} == {
        "test_extra": "failure", "test_fuse_fixture": "error", "test_fuse_fallback": "failure"}, outcomes
    messages = {name: message for name, (_, message) in outcomes.items()}
    assert all("TESTS_REQUIRE_FULL_ENV=1 makes that a failure" in m for m in messages.values()), messages
    assert "agr_no_such_module is not importable" in messages["test_extra"]
    assert "make venv (installs ./worker[lightning])" in messages["test_extra"]
    for name in ("test_fuse_fixture", "test_fuse_fallback"):
        assert "FUSE is unavailable (no fusermount3" in messages[name], messages
        assert "scripts/system_packages.sh fuse" in messages[name], messages


@pytest.mark.parametrize("value", ["yes", "true"])
def test_another_value_is_refused_before_any_test_runs(tmp_path: Path, value: str) -> None:
    proc, outcomes = _run(tmp_path, value)
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error
    assert f"TESTS_REQUIRE_FULL_ENV='{value}': use 1" in proc.stderr and outcomes == {}

"""Test-wide environment: offline google-auth, a throwaway AIRFLOW_HOME, no example DAGs.

This runs before any test module imports Airflow or a Google client, so the settings below
are in place for every import.

What a laptop may lack goes through one switch here: :func:`require_fuse` (and the ``fuse``
fixture) and :func:`require_module` skip a test (or let it fall back to plain folders) where FUSE
or a framework extra is missing, and fail it instead under ``TESTS_REQUIRE_FULL_ENV=1``, which
CI sets, so a broken CI environment cannot pass as skips.
"""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import tempfile
from types import ModuleType
from typing import NoReturn

import pytest

from cloud_run_emulator.process import OFFLINE_ENV

_AIRFLOW_HOME = tempfile.mkdtemp(prefix="agr-airflow-home-")
atexit.register(shutil.rmtree, _AIRFLOW_HOME, ignore_errors=True)

_OFFLINE_ENV = {
    **OFFLINE_ENV,  # google-auth must never probe the metadata server
    "AIRFLOW_HOME": _AIRFLOW_HOME,
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
}
for _key, _value in _OFFLINE_ENV.items():
    os.environ[_key] = _value


#: ``TESTS_REQUIRE_FULL_ENV=1`` (set by ``.ci/run``): what a laptop may lack (FUSE, a framework
#: extra) fails the tests that need it instead of skipping them or falling back to plain folders.
FULL_ENV = "TESTS_REQUIRE_FULL_ENV"
FUSE_INSTALL = ("install fuse3 and libfuse3-3 as root (sudo bash scripts/system_packages.sh fuse) and mfusepy "
                "(make venv installs ./emulator); a container also needs /dev/fuse and CAP_SYS_ADMIN")


def full_env_required() -> bool:
    """Whether ``TESTS_REQUIRE_FULL_ENV`` asks for the full test environment.

    :returns: ``True`` for ``1``, ``False`` when it is unset, empty or ``0``.
    :raises ValueError: for any other value (naming the variable and the allowed values).
    """
    value = os.environ.get(FULL_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{FULL_ENV}={value!r}: use 1 (missing FUSE or extras fail the tests) or 0/unset (they skip).")
    return value == "1"


def missing_from_env(what: str, install: str) -> NoReturn:
    """Skip the calling test because ``what`` is missing, or fail it under ``TESTS_REQUIRE_FULL_ENV=1``.

    :param what: what is missing and why, e.g. ``"FUSE is unavailable (no /dev/fuse)"``.
    :param install: how to install it.
    :raises pytest.fail.Exception: under ``TESTS_REQUIRE_FULL_ENV=1``.
    :raises pytest.skip.Exception: otherwise.
    """
    if full_env_required():
        pytest.fail(f"{what}, and {FULL_ENV}=1 makes that a failure; to fix: {install}", pytrace=False)
    pytest.skip(f"{what} (to run this: {install})")


def require_fuse(fallback: bool = False) -> bool:
    """Whether the emulator's Cloud Storage FUSE volume can be mounted here
    (:func:`~cloud_run_emulator.gcsfuse.fuse_available`).

    :param fallback: where FUSE is unavailable, return ``False`` (the test goes on with plain
        folders) instead of skipping; under ``TESTS_REQUIRE_FULL_ENV=1`` it fails either way.
    :returns: ``True`` when FUSE works, ``False`` (only with ``fallback``) when it does not.
    :raises pytest.fail.Exception: FUSE is unavailable under ``TESTS_REQUIRE_FULL_ENV=1``.
    :raises pytest.skip.Exception: FUSE is unavailable, without ``fallback``.
    """
    from cloud_run_emulator.gcsfuse import fuse_available

    works, why = fuse_available()
    if works:
        return True
    if fallback and not full_env_required():
        return False
    missing_from_env(f"FUSE is unavailable ({why})", FUSE_INSTALL)


def require_module(name: str, extra: str) -> ModuleType:
    """Import ``name``, which the worker's extra ``extra`` installs; skip the test when it is not
    importable, or fail it under ``TESTS_REQUIRE_FULL_ENV=1``.

    :param name: the module, e.g. ``"lightning"``.
    :param extra: the extra of ``./worker`` that installs it, e.g. ``"lightning"``.
    :returns: the module.
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        error = str(exc)  # reported below, outside the handler: the message alone, no chained traceback
    missing_from_env(f"{name} is not importable ({error})",
                     f"make venv (installs ./worker[{extra}]), or pip install -e './worker[{extra}]'")


def pytest_configure(config) -> None:
    """Refuse a bad ``TESTS_REQUIRE_FULL_ENV`` value before anything runs."""
    try:
        full_env_required()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_runtest_setup(item) -> None:
    """Fail a test marked ``serial`` that runs beside others: on more than one pytest-xdist worker
    it would share the cores with other tests, which its wall-clock deadlines, grace periods or
    latencies do not allow for. ``scripts/run_tests.sh`` (``make test``) runs the others with
    ``-m "not serial" -n 3``, then these alone with ``-m serial``."""
    if item.get_closest_marker("serial") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        pytest.fail("marked serial: it must not run on several pytest-xdist workers; select -m 'not serial' "
                    "there and run it alone with -m serial (scripts/run_tests.sh does both)", pytrace=False)


@pytest.fixture(scope="session")
def fuse() -> None:
    """Session fixture for tests that need FUSE: skips them where it is unavailable (fails them
    under ``TESTS_REQUIRE_FULL_ENV=1``; see :func:`require_fuse`)."""
    require_fuse()

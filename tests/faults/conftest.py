"""Fixtures for the fault-injection suite (``pytest -m faults``).

``FAULTS_N`` sets the number of random interruptions of the worker's long run (25 by default,
``make test-faults-long`` uses 200). Worker fixtures come from ``tests/worker/conftest.py``,
the emulator and Airflow fixtures from ``tests/provider/conftest.py``.
"""

from __future__ import annotations

import os

import pytest

from tests.provider.conftest import airflow_db, emulator, faults, gcp_conn, job_name, transport  # noqa: F401 - fixtures
from tests.worker.conftest import digits_npz  # noqa: F401 - fixture


def faults_n() -> int:
    """:return: ``FAULTS_N`` (default 25), at least 1."""
    return max(1, int(os.environ.get("FAULTS_N", "25")))


@pytest.fixture(scope="session")
def n_faults() -> int:
    return faults_n()

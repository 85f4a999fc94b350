"""Test-wide environment: offline google-auth, a throwaway AIRFLOW_HOME, no example DAGs.

This runs before any test module imports Airflow or a Google client, so the settings below
are in place for every import.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from airflow_gpu_resilience.emulator.process import OFFLINE_ENV

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

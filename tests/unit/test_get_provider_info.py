"""Provider metadata: every module and class it names exists, and Airflow finds the provider."""

from __future__ import annotations

import importlib

from airflow_gpu_resilience.get_provider_info import get_provider_info


def test_every_listed_module_and_class_imports():
    info = get_provider_info()
    assert info["package-name"] == "airflow-gpu-resilience"
    for kind in ("hooks", "operators", "sensors", "triggers"):
        for entry in info[kind]:
            for module in entry["python-modules"]:
                importlib.import_module(module)
    for dotted in info["extra-links"]:
        module, _, name = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), name)


def test_does_not_take_over_the_google_connection_type():
    assert get_provider_info()["connection-types"] == []


def test_airflow_providers_list_shows_the_installed_provider(tmp_path):
    """The installed package's entry point is what ``airflow providers list`` reads."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    listed = subprocess.run(
        [sys.executable, "-m", "airflow", "providers", "list", "--output", "json"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )
    start = listed.stdout.index("[")  # skip any log lines before the JSON
    providers = {p["package_name"]: p for p in json.loads(listed.stdout[start:])}
    assert providers["airflow-gpu-resilience"]["version"] == "0.1.0"
    assert "Cloud Run" in providers["airflow-gpu-resilience"]["description"]

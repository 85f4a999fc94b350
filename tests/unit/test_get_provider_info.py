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

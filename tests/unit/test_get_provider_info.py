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


def test_matches_the_installed_airflows_provider_info_schema():
    """Valid against Airflow's own ``provider_info.schema.json``; on Airflow 3 (whose schema lists
    every section a provider may have) no key the schema does not define, at any level."""
    import json
    from pathlib import Path

    import airflow
    import jsonschema

    from airflow_gpu_resilience.compat import AIRFLOW_V_3_0_PLUS

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    info = get_provider_info()
    jsonschema.validate(info, schema)
    if AIRFLOW_V_3_0_PLUS:
        assert set(info) <= set(schema["properties"])
        for key, value in info.items():
            items = schema["properties"][key].get("items", {})
            for entry in value if isinstance(value, list) else []:
                if isinstance(entry, dict):
                    assert set(entry) <= set(items["properties"]), (key, entry)
    hooks = {m for entry in info["hooks"] for m in entry["python-modules"]}
    assert hooks == {"airflow_gpu_resilience.hooks.cloud_run", "airflow_gpu_resilience.hooks.gcs",
                     "airflow_gpu_resilience.hooks.progress", "airflow_gpu_resilience.hooks.cloud_logging"}
    assert {i["integration-name"] for i in info["integrations"]} >= {
        e["integration-name"] for kind in ("hooks", "operators", "sensors", "triggers") for e in info[kind]
    }


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
    from airflow_gpu_resilience import __version__

    assert providers["airflow-gpu-resilience"]["version"] == __version__
    assert "Cloud Run" in providers["airflow-gpu-resilience"]["description"]

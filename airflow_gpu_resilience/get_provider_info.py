"""Provider metadata for Airflow's provider manager (entry point ``apache_airflow_provider``)."""

from __future__ import annotations

from typing import Any

_PKG = "airflow_gpu_resilience"


def get_provider_info() -> dict[str, Any]:
    """Return this provider's metadata as a plain dict.

    Airflow reads it through the ``apache_airflow_provider`` entry point to list the hooks,
    operators, sensors, triggers, extra links and connection types this package contributes.

    Only keys that Airflow's ``provider_info.schema.json`` defines appear (the version is the
    package's own, which ``airflow providers list`` reads from the distribution metadata).

    :return: the provider metadata dict in the shape of Airflow's ``provider_info.schema.json``.
    """
    return {
        "package-name": "airflow-gpu-resilience",
        "name": "GPU Resilience (Cloud Run GPU jobs)",
        "description": (
            "Run long PyTorch GPU jobs on Google Cloud Run from Airflow, surviving "
            "maintenance preemptions by re-running from checkpoints."
        ),
        "integrations": [
            {
                "integration-name": "Google Cloud Run GPU jobs",
                "external-doc-url": "https://cloud.google.com/run/docs/configuring/jobs/gpu",
                "tags": ["gcp"],
            }
        ],
        "hooks": [
            {
                "integration-name": "Google Cloud Run GPU jobs",
                "python-modules": [f"{_PKG}.hooks.cloud_run", f"{_PKG}.hooks.gcs", f"{_PKG}.hooks.progress",
                                   f"{_PKG}.hooks.cloud_logging"],
            }
        ],
        "operators": [
            {
                "integration-name": "Google Cloud Run GPU jobs",
                "python-modules": [f"{_PKG}.operators.cloud_run"],
            }
        ],
        "sensors": [
            {
                "integration-name": "Google Cloud Run GPU jobs",
                "python-modules": [f"{_PKG}.sensors.cloud_run"],
            }
        ],
        "triggers": [
            {
                "integration-name": "Google Cloud Run GPU jobs",
                "python-modules": [f"{_PKG}.triggers.cloud_run"],
            }
        ],
        "extra-links": [
            f"{_PKG}.links.cloud_run.CloudRunGpuExecutionLink",
            f"{_PKG}.links.cloud_run.CloudRunGpuLogsLink",
        ],
        # The hook uses the Google provider's ``google_cloud_platform`` connection type; registering
        # it again here would take that type (and its connection form) away from the Google provider.
        "connection-types": [],
    }

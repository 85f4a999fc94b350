"""Where the provider's hooks send their calls: the emulator over REST or gRPC, or Cloud Run.

The "Connection" page shows each function's body; ``tests/system/test_docs_examples.py`` calls
them and checks where a :class:`~airflow_gpu_resilience.hooks.cloud_run.CloudRunGpuHook` then goes.
Each sets the environment of the process that runs Airflow (a deployment sets the same variables,
or creates the connection in the UI or with ``airflow connections add``).
"""

from __future__ import annotations

import json
import os


def emulator_over_rest(endpoint: str, gcs_endpoint: str) -> None:
    """The emulator's REST server (its ready line's ``endpoint``) through the connection's extra.

    :param endpoint: e.g. ``http://127.0.0.1:8123``.
    :param gcs_endpoint: the GCS emulator, e.g. ``http://127.0.0.1:9023``.
    """
    # [START howto_connection_emulator_rest]
    os.environ["AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT"] = json.dumps({
        "conn_type": "google_cloud_platform",
        "extra": {"project": "local-project", "is_anonymous": True, "api_endpoint": endpoint},
    })
    os.environ["STORAGE_EMULATOR_HOST"] = gcs_endpoint  # google-cloud-storage: the checkpoint bucket
    # [END howto_connection_emulator_rest]


def emulator_over_grpc(grpc_endpoint: str, gcs_endpoint: str) -> None:
    """The emulator's gRPC server (its ready line's ``grpcEndpoint``) through ``CLOUD_RUN_EMULATOR_HOST``.

    :param grpc_endpoint: ``host:port``, e.g. ``127.0.0.1:8124`` (no scheme).
    :param gcs_endpoint: the GCS emulator.
    """
    # [START howto_connection_emulator_grpc]
    os.environ["AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT"] = json.dumps({
        "conn_type": "google_cloud_platform",
        "extra": {"project": "local-project", "is_anonymous": True},
    })
    os.environ["CLOUD_RUN_EMULATOR_HOST"] = grpc_endpoint  # wins over the connection's endpoint
    os.environ["STORAGE_EMULATOR_HOST"] = gcs_endpoint
    # [END howto_connection_emulator_grpc]


def cloud_run(key_path: str) -> None:
    """Google's endpoints with a service account key (leave ``key_path`` out for the
    environment's own credentials: workload identity, or Application Default Credentials).

    :param key_path: path of a service account key file.
    """
    # [START howto_connection_cloud_run]
    os.environ["AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT"] = json.dumps({
        "conn_type": "google_cloud_platform",
        "extra": {"project": "my-project", "key_path": key_path},
    })
    # [END howto_connection_cloud_run]

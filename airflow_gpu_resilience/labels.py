"""The label that marks Google Cloud resources this provider created (or that their owner adopted).

The checkpoint bucket hook (:class:`~airflow_gpu_resilience.hooks.gcs.CheckpointBucketHook`)
deletes, and grants on, only a bucket that carries it; the Cloud Run hook's
:meth:`~airflow_gpu_resilience.hooks.cloud_run.CloudRunGpuHook.create_or_update_job` updates only
a job that carries it, and puts it on every job it creates. Label keys and values follow Google
Cloud's label rules (lowercase letters, digits, ``-`` and ``_``; at most 63 characters).
"""

from __future__ import annotations

from collections.abc import Mapping

#: Label key and value that mark a resource this provider created (or that its owner adopted).
MANAGED_BY_LABEL = "managed-by"
MANAGED_BY_VALUE = "airflow-gpu-resilience"


def is_managed(labels: Mapping[str, str]) -> bool:
    """:return: whether ``labels`` carry ``managed-by=airflow-gpu-resilience``.

    :param labels: a resource's labels (a bucket's ``labels``, a ``run_v2.Job``'s ``labels``).
    """
    return labels.get(MANAGED_BY_LABEL) == MANAGED_BY_VALUE


def with_managed_label(labels: Mapping[str, str]) -> dict[str, str]:
    """:return: a copy of ``labels`` with ``managed-by=airflow-gpu-resilience`` set.

    :param labels: the labels a resource is created or updated with.
    """
    return {**labels, MANAGED_BY_LABEL: MANAGED_BY_VALUE}

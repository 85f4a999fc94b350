"""The checkpoint bucket: created labelled as ours, told apart from someone else's, deleted in batches.

A bucket name is global across Google Cloud, so "the bucket already exists" (HTTP 409) means
either *ours, from an earlier run* or *someone else's*. Only the first may receive the job's IAM
grant, the dataset, checkpoints, or be deleted. The rules:

- :meth:`CheckpointBucketHook.ensure_bucket` creates the bucket with the labels
  ``managed-by=airflow-gpu-resilience`` and ``gcp-project=<project id>``
  (:func:`ownership_labels`). On a 409 it reads the existing bucket and accepts it only if it
  carries ``managed-by=airflow-gpu-resilience``, its ``gcp-project`` label (when present) names
  the same project, and the Storage API lists it in that project. Otherwise it raises
  :class:`~airflow_gpu_resilience.exceptions.CheckpointBucketNotOursError` before anything
  else touches the bucket.
- :meth:`CheckpointBucketHook.delete_bucket_and_contents` deletes a bucket only after the same
  check, object generations in batches of :data:`DELETE_BATCH_SIZE` (one batch request each),
  then the bucket, and reports how many objects and bytes it deleted. The client's own
  ``Bucket.delete(force=True)`` refuses buckets with more than 256 objects; a checkpoint bucket
  passes that after a few runs.

To adopt an existing bucket deliberately, add the label yourself:
``gcloud storage buckets update gs://BUCKET --update-labels=managed-by=airflow-gpu-resilience``.

Every call goes through the Google provider's ``GCSHook`` client, so the connection, its
credentials and ``STORAGE_EMULATOR_HOST`` apply as for any GCS task.
"""

from __future__ import annotations

import re
from itertools import islice
from typing import Any

from airflow.providers.google.cloud.hooks.gcs import GCSHook
from google.api_core import exceptions as gexc
from google.cloud import storage

from airflow_gpu_resilience.exceptions import CheckpointBucketNotOursError
from airflow_gpu_resilience.labels import MANAGED_BY_LABEL, MANAGED_BY_VALUE

#: Label key holding the project id the bucket was created for.
PROJECT_LABEL = "gcp-project"
#: Objects deleted per batch request (the JSON API accepts at most 100 calls in one batch).
DELETE_BATCH_SIZE = 100


def project_label_value(project_id: str) -> str:
    """:return: ``project_id`` as a label value: ``[a-z0-9_-]``, at most 63 characters (a
        domain-scoped id such as ``example.com:proj`` becomes ``example_com_proj``).

    :param project_id: the Google Cloud project id.
    """
    return re.sub(r"[^a-z0-9_-]", "_", project_id.lower())[:63]


def ownership_labels(project_id: str) -> dict[str, str]:
    """:return: the labels :meth:`CheckpointBucketHook.ensure_bucket` puts on a bucket it creates:
        ``managed-by=airflow-gpu-resilience`` and ``gcp-project=<project id as a label value>``.

    :param project_id: the Google Cloud project id.
    """
    return {MANAGED_BY_LABEL: MANAGED_BY_VALUE, PROJECT_LABEL: project_label_value(project_id)}


class CheckpointBucketHook(GCSHook):
    """``GCSHook`` with the checkpoint bucket's life cycle: ensure it is ours, delete it whole.

    :param gcp_conn_id: the ``google_cloud_platform`` connection (default ``google_cloud_default``).
        Other keyword arguments go to ``GCSHook``.
    """

    def ensure_bucket(
        self,
        bucket_name: str,
        project_id: str,
        location: str,
        storage_class: str = "STANDARD",
        labels: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Create the bucket labelled as ours, or accept an existing one only if it is ours.

        :param bucket_name: the bucket name.
        :param project_id: the project that creates (and must own) the bucket.
        :param location: bucket location, e.g. ``us-central1``.
        :param storage_class: storage class of a new bucket (default ``STANDARD``).
        :param labels: extra labels for a new bucket (the ownership labels always win).
        :return: ``{"bucket", "created" (bool), "labels", "project_number"}``.
        :raises CheckpointBucketNotOursError: the bucket exists and is someone else's (or cannot
            be read); nothing was changed on it.
        :raises ValueError: an empty ``bucket_name`` or ``project_id``.
        """
        if not bucket_name or not project_id:
            raise ValueError(f"bucket_name and project_id must be non-empty, got {bucket_name!r}, {project_id!r}")
        client = self.get_conn()
        bucket = client.bucket(bucket_name)
        bucket.storage_class = storage_class
        wanted = {**(labels or {}), **ownership_labels(project_id)}
        bucket.labels = wanted
        try:
            bucket = client.create_bucket(bucket, project=project_id, location=location)
        except gexc.Conflict:
            bucket = self._existing_bucket(client, bucket_name)
            self.check_ours(bucket, project_id)
            self.log.info("Bucket %s exists and is ours (labels %s): using it", bucket_name, dict(bucket.labels))
            return self._describe(bucket, created=False)
        if any(bucket.labels.get(k) != v for k, v in wanted.items()):
            # The API answered with the bucket it made; a server that dropped the labels (the
            # local GCS emulator ignores them on insert) gets them set explicitly.
            bucket.labels = {**bucket.labels, **wanted}
            bucket.patch()
        self.log.info("Created bucket %s in %s (%s), labels %s", bucket_name, location, storage_class,
                      dict(bucket.labels))
        return self._describe(bucket, created=True)

    def check_ours(self, bucket: storage.Bucket, project_id: str) -> None:
        """Raise unless ``bucket`` (as read from the API) is ours in ``project_id``.

        Ours: it carries ``managed-by=airflow-gpu-resilience``; its ``gcp-project`` label, if
        any, is ``project_id``; and listing the project's buckets shows it (when the caller may
        list them; without that permission the labels decide, and a warning says so).

        :param bucket: the bucket, loaded (``client.get_bucket``).
        :param project_id: the project that must own it.
        :raises CheckpointBucketNotOursError: naming the bucket, why, and what to do.
        """
        labels = bucket.labels or {}
        if labels.get(MANAGED_BY_LABEL) != MANAGED_BY_VALUE:
            raise CheckpointBucketNotOursError(
                bucket.name, f"it has no label {MANAGED_BY_LABEL}={MANAGED_BY_VALUE} (its labels: {dict(labels)})")
        if labels.get(PROJECT_LABEL, project_label_value(project_id)) != project_label_value(project_id):
            raise CheckpointBucketNotOursError(
                bucket.name, f"its label {PROJECT_LABEL}={labels[PROJECT_LABEL]} names another project than {project_id}")
        listed = self._listed_in_project(bucket, project_id)
        if listed is False:
            raise CheckpointBucketNotOursError(
                bucket.name, f"it is not a bucket of project {project_id} (its project number: {bucket.project_number})")

    def delete_bucket_and_contents(self, bucket_name: str, project_id: str) -> dict[str, Any]:
        """Delete every object generation of an owned bucket in batches, then the bucket.

        :param bucket_name: the bucket name.
        :param project_id: the project that must own it (see :meth:`check_ours`).
        :return: ``{"bucket", "deleted" (bool: False when it did not exist), "objects_deleted",
            "bytes_deleted"}``.
        :raises CheckpointBucketNotOursError: the bucket is not ours; nothing was deleted.
        :raises google.api_core.exceptions.GoogleAPICallError: a delete failed (what was deleted
            before stays deleted; running it again continues).
        """
        client = self.get_conn()
        try:
            bucket = client.get_bucket(bucket_name)
        except gexc.NotFound:
            self.log.info("Bucket %s does not exist; nothing to delete", bucket_name)
            return {"bucket": bucket_name, "deleted": False, "objects_deleted": 0, "bytes_deleted": 0}
        except gexc.Forbidden as error:
            raise CheckpointBucketNotOursError(bucket_name, f"reading it is forbidden ({error.message})") from error
        self.check_ours(bucket, project_id)
        objects = size = 0
        missing: set = set()
        while True:
            # islice: a server that ignores maxResults must not make a batch over the limit
            page = list(islice(client.list_blobs(bucket, versions=True, page_size=DELETE_BATCH_SIZE),
                               DELETE_BATCH_SIZE))
            if not page:
                break
            keys = {(blob.name, blob.generation) for blob in page}
            if keys & missing:
                raise RuntimeError(f"Bucket {bucket_name}: objects answered 404 on delete yet are still listed: "
                                   f"{sorted(keys & missing)[:5]}")
            try:
                with client.batch(raise_exception=True):
                    for blob in page:
                        bucket.delete_blob(blob.name, generation=blob.generation)
            except gexc.NotFound:
                missing = keys  # some were gone already (deleted meanwhile): counted as deleted
            else:
                missing = set()
            objects += len(page)
            size += sum(blob.size or 0 for blob in page)
            self.log.info("Bucket %s: %d objects (%d bytes) deleted so far", bucket_name, objects, size)
        bucket.delete()
        self.log.info("Deleted bucket %s: %d objects, %d bytes", bucket_name, objects, size)
        return {"bucket": bucket_name, "deleted": True, "objects_deleted": objects, "bytes_deleted": size}

    def _existing_bucket(self, client: storage.Client, bucket_name: str) -> storage.Bucket:
        try:
            return client.get_bucket(bucket_name)
        except gexc.Forbidden as error:
            raise CheckpointBucketNotOursError(
                bucket_name, f"it exists and reading it is forbidden ({error.message})") from error

    def _listed_in_project(self, bucket: storage.Bucket, project_id: str) -> bool | None:
        """Whether the project's bucket listing holds ``bucket``; ``None`` if listing is forbidden."""
        client = self.get_conn()
        try:
            for candidate in client.list_buckets(project=project_id, prefix=bucket.name):
                if candidate.name == bucket.name:
                    return True
        except gexc.Forbidden:
            self.log.warning("May not list the buckets of project %s: bucket %s is accepted on its labels only",
                             project_id, bucket.name)
            return None
        return False

    @staticmethod
    def _describe(bucket: storage.Bucket, *, created: bool) -> dict[str, Any]:
        return {"bucket": bucket.name, "created": created, "labels": dict(bucket.labels or {}),
                "project_number": bucket.project_number}

"""The ownership label's pure helpers (table-driven)."""

from __future__ import annotations

import pickle

import pytest

from airflow_gpu_resilience.exceptions import CloudRunJobNotOursError
from airflow_gpu_resilience.labels import is_managed, with_managed_label


@pytest.mark.parametrize(
    ("labels", "managed"),
    [
        ({"managed-by": "airflow-gpu-resilience"}, True),
        ({"managed-by": "airflow-gpu-resilience", "team": "ml"}, True),
        ({}, False),
        ({"managed-by": "terraform"}, False),
        ({"managed_by": "airflow-gpu-resilience"}, False),
        ({"managed-by": "Airflow-GPU-Resilience"}, False),
    ],
)
def test_is_managed(labels, managed):
    assert is_managed(labels) is managed


def test_with_managed_label_copies_and_overrides():
    mine = {"team": "ml", "managed-by": "terraform"}
    assert with_managed_label(mine) == {"team": "ml", "managed-by": "airflow-gpu-resilience"}
    assert mine == {"team": "ml", "managed-by": "terraform"}


def test_job_not_ours_error_names_the_job_and_survives_pickling():
    err = CloudRunJobNotOursError("projects/p/locations/l/jobs/train", {"team": "x"})
    assert "gcloud run jobs update train --update-labels=managed-by=airflow-gpu-resilience" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert (again.job, again.labels, str(again)) == (err.job, err.labels, str(err))

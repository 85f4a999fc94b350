"""Cloud Run's rules, kept twice on purpose: the provider checks a job before deploying it
(:mod:`airflow_gpu_resilience.cloud_run_rules`, :mod:`~airflow_gpu_resilience.job_spec`), the
emulator is an oracle of its own (:mod:`cloud_run_emulator.validation`; the two distributions share
no code). One table of inputs runs through both and the verdicts must agree: a value both accept
has the same meaning, a value one refuses the other refuses too. (Mount options have their own
table: ``test_mount_options.py``.)
"""

from __future__ import annotations

import pytest

from airflow_gpu_resilience import cloud_run_rules as provider
from airflow_gpu_resilience import job_spec
from cloud_run_emulator import validation as emulator
from cloud_run_emulator.exceptions import InvalidArgument

CPU = ["4", "4.5", "0.5", "4000m", "500m", "8", "1e1", "-1", "four", "4Gi", "", "4mm", "nan", "inf", "4.", ".5"]
MEMORY = ["16Gi", "16384Mi", "17G", "16k", "16K", "16", "1Ti", "16T", "512Mi", "16m", "-1Gi", "1e3Mi", "16Gb",
          "16gi", "", "Gi", "16.5Gi"]
JOB_NAMES = ["train", "my-job-1", "a", "a" * 63, "a" * 64, "1job", "-job", "job-", "Job", "my_job", "my.job", ""]
BUCKETS = ["my-bucket", "ab", "abc", "a" * 63, "a" * 64, "my.bucket.example.com", "192.168.1.1", "goog-bucket",
           "my-google-bucket", "my_bucket", "-bucket", "bucket-", "Bucket", "a..b", "a.-b", "x" * 64 + ".example.com"]
#: Project ids as they appear in ``projects/{project}``: ids, domain-scoped ids (legal Google Cloud
#: project ids of older Google Workspace projects; Cloud Run's names carry them as they are) and
#: project numbers. Neither side knows more of a domain than its form: two or more labels.
PROJECT_IDS = ["my-project", "a" * 6, "a" * 30, "a" * 5, "a" * 31, "1project", "-project", "project-", "My-Project",
               "my_project", "123456", "1", "0123", "1" * 20, "1" * 21, "example.com:my-project",
               "sub.example.co.uk:my-project", "example.com:my", "example.com:123456", "example:my-project",
               "example..com:my-project", "-example.com:my-project", "example-.com:my-project",
               "Example.com:my-project", ":my-project", "example.com:", "example.com:my-project:x",
               "example.com/my-project", "..", "my-project\n", ""]


def _provider(parse, value):
    try:
        return parse(value)
    except ValueError:
        return "refused"


def _emulator(check, *args):
    """:return: ``check(*args)``, or ``"refused"`` when the emulator answers InvalidArgument."""
    try:
        return check(*args)
    except InvalidArgument:
        return "refused"


@pytest.mark.parametrize("value", CPU)
def test_cpu_quantities(value):
    assert _provider(provider.parse_cpu, value) == _emulator(emulator.parse_cpu, value, "field")


@pytest.mark.parametrize("value", MEMORY)
def test_memory_quantities(value):
    mine, theirs = _provider(provider.parse_memory_gib, value), _emulator(emulator.parse_memory_gib, value, "field")
    assert mine == theirs if "refused" in (mine, theirs) else mine == pytest.approx(theirs)


@pytest.mark.parametrize("name", JOB_NAMES)
def test_job_names(name):
    assert _provider(provider.validate_job_name, name) == _emulator(emulator.validate_job_id, name)


@pytest.mark.parametrize("project", PROJECT_IDS)
def test_project_ids(project):
    assert _provider(provider.validate_project_id, project) == \
        _emulator(emulator.validate_project_location, project, "us-central1", "name")


@pytest.mark.parametrize("bucket", BUCKETS)
def test_bucket_names(bucket):
    mine = provider.bucket_name_problem(bucket) is not None
    assert mine == (_emulator(emulator.validate_bucket_name, bucket) == "refused")


def test_gpu_types_task_count_and_reserved_env():
    assert dict(job_spec.GPU_TYPES) == emulator.GPU_TYPES
    assert job_spec.MAX_TASK_COUNT == emulator.MAX_TASK_COUNT
    assert set(emulator.RESERVED_ENV) <= set(job_spec.RESERVED_ENV)

"""The deploy and execute operators' argument checks: bad parameters refused when the DAG is parsed
(one ValueError naming the parameter), templated values checked once rendered before any API call,
and the deploy operator's spec arguments matching :class:`GpuJobSpec`'s fields and defaults."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from airflow_gpu_resilience.job_spec import GpuJobSpec
from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuDeployJobOperator, CloudRunGpuExecuteJobOperator
from tests.provider.conftest import BUCKET

pytestmark = pytest.mark.usefixtures("airflow_db")


def test_deploy_operator_validates_at_parse_time_when_not_templated():
    with pytest.raises(ValueError, match="gpu_type='nvidia-h100' is not supported"):
        CloudRunGpuDeployJobOperator(task_id="d", job_name="j", image="img", gpu_type="nvidia-h100",
                                     checkpoint_bucket=BUCKET)


def test_deploy_operator_validates_templated_values_before_any_api_call():
    op = CloudRunGpuDeployJobOperator(task_id="d", job_name="j", image="img", max_retries="{{ x }}",
                                      checkpoint_bucket=BUCKET)
    op.max_retries = "12"  # as rendered
    with pytest.raises(ValueError, match="max_retries=12 is out of range"):
        op.execute({})


def test_deploy_operator_takes_every_spec_field_with_the_specs_default():
    """The deploy operator's spec arguments are GpuJobSpec's fields (``name`` is ``job_name``)."""
    from airflow.providers.common.compat.sdk import DAG

    parameters = inspect.signature(CloudRunGpuDeployJobOperator.__init__).parameters
    for spec_field in dataclasses.fields(GpuJobSpec):
        if spec_field.name == "name":
            continue
        if spec_field.default_factory is not dataclasses.MISSING:
            default = spec_field.default_factory()
        else:
            default = inspect.Parameter.empty if spec_field.default is dataclasses.MISSING else spec_field.default
        assert parameters[spec_field.name].default == default, spec_field.name
        assert spec_field.name in CloudRunGpuDeployJobOperator.template_fields
    with DAG(dag_id="defaults", schedule=None, default_args={"memory": "32Gi", "max_retries": 5}):
        op = CloudRunGpuDeployJobOperator(task_id="d", job_name="j", image="img", checkpoint_bucket=BUCKET)
    spec = op.build_spec()
    assert (spec.memory, spec.max_retries, spec.cpu, spec.env) == ("32Gi", 5, "4", {})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gpu_type": "nvidia-h100"}, r"gpu_type='nvidia-h100' is not supported; allowed: \['nvidia-l4', 'nvidia-rtx-pro-6000'\]"),
        ({"max_retries": 11}, r"max_retries=11 is out of range: allowed integers are 0-10"),
        ({"task_timeout": 168 * 3600 + 1}, r"task_timeout=604801 s is out of range: allowed 1-604800 seconds \(168 h\)"),
        ({"memory": "8Gi"}, r"memory='8Gi' is below the nvidia-l4 minimum of 16 GiB"),
        ({"image": ""}, r"image must be a non-empty container image URI"),
        ({"checkpoint_bucket": "Bad_Bucket"}, r"checkpoint_bucket='Bad_Bucket' is not a valid Cloud Storage bucket name"),
        ({"adopt_existing_job": "yes"}, r"adopt_existing_job='yes' must be True or False"),
    ],
)
def test_deploy_operator_rejects_bad_parameters_when_the_dag_is_parsed(kwargs, match):
    """Bad parameters: no operator (and so no API call) is ever built."""
    base = {"task_id": "d", "job_name": "train", "image": "img", "checkpoint_bucket": BUCKET}
    with pytest.raises(ValueError, match=match):
        CloudRunGpuDeployJobOperator(**{**base, **kwargs})


def test_execute_operator_rejects_negative_budget():
    with pytest.raises(ValueError, match="max_preemption_reruns=-1"):
        CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", max_preemption_reruns=-1)


def test_execute_operator_rejects_a_bad_timeout():
    with pytest.raises(ValueError, match="timeout=0 must be a positive"):
        CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", timeout=0)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"wait_timeout": 0}, "wait_timeout=0"),
    ({"wait_timeout": -3}, "wait_timeout=-3"),
    ({"wait_timeout": "ten minutes"}, "wait_timeout='ten minutes'"),
    ({"wait_timeout": float("nan")}, "wait_timeout=nan"),
    ({"wait_timeout": float("inf")}, "wait_timeout=inf"),
    ({"timeout": float("inf")}, "timeout=inf"),
    ({"timeout": "abc"}, "timeout='abc'"),
    ({"timeout": True}, "timeout=True"),
    ({"poll_interval": 0}, "poll_interval=0"),
    ({"poll_interval": -5}, "poll_interval=-5"),
    ({"poll_interval": float("inf")}, "poll_interval=inf"),
])
def test_execute_operator_rejects_bad_durations_when_the_dag_is_parsed(kwargs, named):
    """One ValueError naming the parameter, from the constructor: no execution can start."""
    with pytest.raises(ValueError, match=re.escape(named) + " must be a positive, finite number of seconds"):
        CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", **kwargs)


def test_durations_given_as_numeric_strings_are_seconds():
    op = CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", wait_timeout="600", timeout="3600")
    assert (op.wait_timeout, op.timeout) == (600.0, 3600.0)


def test_a_templated_poll_interval_is_checked_once_rendered():
    op = CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", poll_interval="{{ params.poll }}")
    op.poll_interval = "0"  # as rendered
    with pytest.raises(ValueError, match="poll_interval='0' must be a positive, finite number of seconds"):
        op.execute({})

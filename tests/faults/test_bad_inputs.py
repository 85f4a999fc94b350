"""Bad inputs: wrong DAG params and job specs each give ONE clear error naming the parameter,
before any Cloud Run API call (the emulator has no job and no execution afterwards)."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.job_spec import GpuJobSpec
from tests.provider.conftest import BUCKET, REGION, STUB_IMAGE

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"
DAG_ID = "gpu_resilient_training"
#: A project no other test uses, so "no job in the emulator" means none from these cases.
PROJECT = "faults-bad-inputs"
#: The project of the execute operator's cases: they deploy a job, so not :data:`PROJECT`.
EXECUTE_PROJECT = "faults-bad-execute"


@pytest.fixture(scope="module")
def training_dag():
    sys.path.insert(0, str(DAGS))
    from tests.airflow_compat import DagBag

    return DagBag(dag_folder=str(DAGS / f"{DAG_ID}.py")).dags[DAG_ID]


def no_jobs_in(project: str, region: str) -> None:
    hook = CloudRunGpuHook()
    client = hook.jobs_client(region)
    assert list(client.list_jobs(parent=f"projects/{project}/locations/{region}")) == []


#: conf -> the parameter the one error must name (JSON-schema checks at DAG-run creation, or the
#: deploy operator's own validation when the schema lets the value through).
BAD_PARAMS = [
    ({"job_name": "Bad_Name"}, "job_name"),
    ({"job_name": "-starts-with-dash"}, "job_name"),
    ({"job_name": "x" * 80}, "job_name"),
    ({"image": ""}, "image"),
    ({"bucket": "Bad_Bucket"}, "bucket"),
    ({"bucket": ""}, "bucket"),
    ({"gpu_type": "nvidia-h100"}, "gpu_type"),
    ({"max_retries": 11}, "max_retries"),
    ({"max_retries": -1}, "max_retries"),
    ({"max_retries": "3"}, "max_retries"),
    ({"max_preemption_reruns": -1}, "max_preemption_reruns"),
    ({"task_timeout_seconds": 0}, "task_timeout"),
    ({"task_timeout_seconds": 168 * 3600 + 1}, "task_timeout"),
    ({"task_timeout_seconds": 3.5}, "task_timeout"),
    ({"poll_interval_seconds": 0}, "poll_interval"),
    ({"steps": 0}, "steps"),
    ({"steps": "many"}, "steps"),
    ({"checkpoint_every": 0}, "checkpoint_every"),
    ({"hidden_units": 0}, "hidden_units"),
    ({"seed": -1}, "seed"),
    ({"step_delay_seconds": -0.5}, "step_delay_seconds"),
]


def first_error(dag, conf: dict, context_ti) -> Exception:
    """What a user sees for ``conf``: the param check when the DAG run is created, else the error
    of rendering and executing ``deploy_job`` (which validates before its first API call)."""
    from tests.airflow_compat import ParamValidationError

    params = copy.deepcopy(dag.params)
    try:
        params.update(conf)
        values = params.validate()
    except ParamValidationError as exc:
        return exc
    task = copy.copy(dag.get_task("deploy_job"))
    task.render_template_fields({"params": values}, jinja_env=dag.get_template_env())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            task.execute({"ti": context_ti})
        except (ValueError, TypeError) as exc:
            return exc
    pytest.fail(f"{conf} was accepted")


class _TI:
    def xcom_push(self, key, value):
        raise AssertionError(f"deploy pushed {key}={value}: it reached the API")


@pytest.mark.parametrize(("conf", "name"), BAD_PARAMS, ids=[next(iter(c)) + "=" + repr(next(iter(c.values())))[:20]
                                                             for c, _ in BAD_PARAMS])
def test_bad_dag_param_names_the_parameter_before_any_api_call(training_dag, emulator, gcp_conn, conf, name):
    error = first_error(training_dag, {"project_id": PROJECT, "region": REGION, **conf}, _TI())
    message = str(error)
    assert name in message.splitlines()[0], message
    no_jobs_in(PROJECT, REGION)


def _spec(**kw):
    values = {"name": "train", "image": "img", "checkpoint_bucket": BUCKET, **kw}
    return GpuJobSpec(**{k: v for k, v in values.items() if v is not ...})


BAD_SPECS = [
    ({"name": "Bad_Name"}, "name="),
    ({"name": ""}, "name="),
    ({"name": "a" * 64}, "name="),
    ({"image": ...}, "image"),
    ({"image": ""}, "image"),
    ({"image": None}, "image"),
    ({"checkpoint_bucket": ""}, "checkpoint_bucket="),
    ({"checkpoint_bucket": "Bad_Bucket"}, "checkpoint_bucket="),
    ({"max_retries": "3"}, "max_retries="),
    ({"max_retries": True}, "max_retries="),
    ({"max_retries": 11}, "max_retries="),
    ({"task_count": 0}, "task_count="),
    ({"task_timeout": "1h"}, "task_timeout="),
    ({"task_timeout": 0}, "task_timeout="),
    ({"cpu": "lots"}, "cpu="),
    ({"memory": "8Gi"}, "memory="),
    ({"gpu_type": "nvidia-h100"}, "gpu_type="),
    ({"gpu_count": 2}, "gpu_count="),
    ({"parallelism": -1}, "parallelism="),
    ({"args": "train"}, "args="),  # a lone string used to become ['t', 'r', 'a', 'i', 'n']
    ({"args": ["train", 600]}, "args="),
    ({"command": "python"}, "command="),
    ({"args": None}, "args="),
    ({"service_account": 5}, "service_account="),
    ({"env": {"STEPS": 600}}, "env["),
    ({"labels": {"Team": "ml"}}, "label key"),
    ({"checkpoint_mount_path": "relative"}, "checkpoint_mount_path="),
]


@pytest.mark.parametrize(("kwargs", "name"), BAD_SPECS, ids=[repr(k)[:30] for k, _ in BAD_SPECS])
def test_bad_job_spec_names_the_field_before_any_api_call(emulator, gcp_conn, kwargs, name):
    with pytest.raises((ValueError, TypeError)) as caught:
        _spec(**kwargs)
    assert name in str(caught.value), str(caught.value)
    no_jobs_in(PROJECT, REGION)


def no_executions_in(project: str, region: str) -> None:
    """Cloud Run (the emulator) lists no execution of any job in ``project`` and ``region``."""
    client = CloudRunGpuHook().executions_client(region)
    assert list(client.list_executions(parent=f"projects/{project}/locations/{region}/jobs/-")) == []


def deploy_valid_job(job_name: str) -> None:
    """A job the execute operator's cases could run: a bad argument is all that stops them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = GpuJobSpec(name=job_name, image=STUB_IMAGE, max_retries=0, checkpoint_bucket=BUCKET)
    CloudRunGpuHook().create_job(job_name=job_name, job=spec, region=REGION, project_id=EXECUTE_PROJECT)


class _ExecuteTI:
    dag_id, run_id, task_id, map_index = "bad_inputs", "run-1", "execute", -1

    def xcom_push(self, key, value):
        raise AssertionError(f"execute pushed {key}={value}: it reached the API")


#: The execute operator's arguments (beside a valid job's) -> the start of its one error: what
#: Cloud Run would refuse (issue 39 item 4) and the operator's own arguments (item 5).
BAD_EXECUTE_ARGS = [
    ({"overrides": {"container_overrides": [{"env": [{"name": "A", "value": "1"}, {"name": "A=B", "value": "1"}]}]}},
     "overrides['container_overrides'][0]['env'][1]['name']: name 'A=B' must not contain '='"),
    ({"overrides": {"container_overrides": [{"env": [{"name": "", "value": "1"}]}]}},
     "overrides['container_overrides'][0]['env'][0]['name']: name '' must be a non-empty string"),
    ({"overrides": {"container_overrides": [{"env": [{"name": "A", "value": "a\x00b"}]}]}},
     "overrides['container_overrides'][0]['env'][0]['value']: value of 'A' must not contain NUL"),
    ({"overrides": {"container_overrides": [{"args": ["a\x00b"]}]}},
     "overrides['container_overrides'][0]['args'][0]='a\\x00b' must not contain NUL"),
    ({"overrides": {"task_count": 10001}}, "overrides['task_count']=10001 must be an integer from 1 to 10000"),
    ({"job_name": "Bad_Name"}, "job_name='Bad_Name' is not a valid Cloud Run job name"),
    ({"job_name": "a" * 64}, "job_name='aaaa"),
    ({"project_id": "Bad Project"}, "project_id='Bad Project' is not a Google Cloud project id"),
    ({"region": "us central1"}, "region='us central1' is not a Cloud Run region"),
    ({"checkpoint_bucket": "Bad_Bucket"}, "checkpoint_bucket='Bad_Bucket' is not a valid Cloud Storage bucket name"),
    ({"checkpoint_bucket": "gs://bucket"}, "checkpoint_bucket='gs://bucket' is not a valid Cloud Storage bucket"),
    ({"fatal_exit_codes": [64, 300]}, "fatal_exit_codes=[64, 300] holds 300: exit codes are integers from 1 to 255"),
    ({"fatal_exit_codes": "78"}, "fatal_exit_codes='78' must be a collection of exit codes"),
    ({"fatal_exit_codes": [0]}, "fatal_exit_codes=[0] holds 0"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_EXECUTE_ARGS, ids=[m[:48] for _, m in BAD_EXECUTE_ARGS])
def test_bad_execute_argument_names_it_before_any_execution_starts(emulator, gcp_conn, job_name, kwargs, message):
    """One ValueError naming the argument as the user wrote it, at construction or at execute, and
    no execution in Cloud Run (a valid job of that name exists, so the API would have run it)."""
    from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator

    deploy_valid_job(job_name)
    arguments = {"job_name": job_name, "region": REGION, "project_id": EXECUTE_PROJECT, "deferrable": False,
                 "poll_interval": 0.1, **kwargs}
    with pytest.raises(ValueError) as raised:
        CloudRunGpuExecuteJobOperator(task_id="execute", **arguments).execute({"ti": _ExecuteTI()})
    assert str(raised.value).startswith(message), str(raised.value)
    no_executions_in(EXECUTE_PROJECT, REGION)


@pytest.mark.parametrize(("name", "value"), [("job_name", "Bad_Name"), ("region", "us central1"),
                                             ("project_id", "Bad Project"), ("checkpoint_bucket", "Bad_Bucket")])
def test_a_templated_argument_is_checked_once_rendered_before_any_execution_starts(emulator, gcp_conn, job_name,
                                                                                    name, value):
    from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator

    deploy_valid_job(job_name)
    arguments = {"job_name": job_name, "region": REGION, "project_id": EXECUTE_PROJECT, name: "{{ params.value }}"}
    op = CloudRunGpuExecuteJobOperator(task_id="execute", deferrable=False, **arguments)  # not checked yet
    setattr(op, name, value)  # as rendered
    with pytest.raises(ValueError, match=f"^{name}={value!r} is not a"):
        op.execute({"ti": _ExecuteTI()})
    no_executions_in(EXECUTE_PROJECT, REGION)


def test_missing_bucket_is_a_loud_warning_not_a_silent_restart_from_scratch():
    with pytest.warns(UserWarning, match="checkpoint_bucket is None"):
        _spec(checkpoint_bucket=None)


@pytest.mark.e2e
def test_airflow_dags_test_with_a_bad_param_fails_before_any_api_call(tmp_path: Path):
    """The real command line: ``airflow dags test gpu_resilient_training --conf '{"max_retries": 11}'``
    against an emulator fails, the output names the param, and no job or execution exists."""
    import importlib.util

    from cloud_run_emulator.process import EmulatorProcess

    spec = importlib.util.spec_from_file_location("agr_demo_faults", REPO / "scripts" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    with EmulatorProcess(tmp_path / "emulator", images_file=REPO / "worker" / "emulator-image.json") as emulator:
        log = tmp_path / "dags-test.log"
        rc = demo.run_dag(demo.airflow_env(tmp_path, emulator), {"max_retries": 11, "job_name": "Bad_Name"}, log)
        text = log.read_text()
        assert rc != 0, text[-4000:]
        assert "Invalid input for param" in text and ("max_retries" in text or "job_name" in text), text[-4000:]
        from google.api_core.client_options import ClientOptions
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import run_v2

        client = run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest",
                                   client_options=ClientOptions(api_endpoint=emulator.endpoint))
        assert list(client.list_jobs(parent=f"projects/{demo.PROJECT}/locations/{REGION}")) == []

"""CloudRunGpuExecutionSensor against the emulator: poke, and poke/deferrable through dag.test()."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from airflow.utils.state import TaskInstanceState

from airflow_gpu_resilience.exceptions import CloudRunGpuFatalError
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.job_spec import GpuJobSpec
from airflow_gpu_resilience.sensors.cloud_run import CloudRunGpuExecutionSensor
from tests.provider.conftest import BUCKET, PROJECT, REGION, STUB_IMAGE, wait_until_running
from tests.provider.operators import dag_factory
from tests.provider.operators.dag_factory import CAPTURED, write_dag_file


def start(job_name: str, args: list[str], wait: bool = True, max_retries: int = 0) -> str:
    hook = CloudRunGpuHook()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = GpuJobSpec(name=job_name, image=STUB_IMAGE, args=args, max_retries=max_retries,
                          checkpoint_bucket=BUCKET)
    hook.create_job(job_name=job_name, job=spec, region=REGION, project_id=PROJECT)
    execution = hook.run_job(job_name=job_name, region=REGION, project_id=PROJECT)[1]
    if wait:
        hook.wait_for_execution(execution, poll_interval=0.1, timeout=30)
    return execution


def test_poke_success_and_failure(gcp_conn, job_name):
    ok = start(job_name, ["ok"])
    sensor = CloudRunGpuExecutionSensor(task_id="s", execution=ok.rsplit("/", 1)[-1], job_name=job_name, region=REGION)
    result = sensor.poke({})
    assert result.is_done and result.xcom_value["state"] == "SUCCEEDED" and result.xcom_value["execution"] == ok
    failed = start(f"{job_name}-f", ["exit", "1"])
    with pytest.raises(CloudRunGpuFatalError, match="ended FAILED"):
        CloudRunGpuExecutionSensor(task_id="s", execution=failed).poke({})


def test_short_name_needs_job_name(gcp_conn):
    with pytest.raises(ValueError, match="short name or missing: set job_name"):
        CloudRunGpuExecutionSensor(task_id="s", execution="abc").poke({})


@pytest.mark.usefixtures("airflow_db")
@pytest.mark.parametrize(("deferrable", "mode"), [(True, "poke"), (False, "poke"), (False, "reschedule")])
def test_sensor_in_a_dag(gcp_conn, job_name, deferrable, mode):
    """The execution is still running (sleep 1 s) when the sensor starts."""
    from airflow.configuration import conf

    CAPTURED["summaries"].clear()
    execution = start(job_name, ["sleep", "1"], wait=False)
    kwargs = {"dag_id": f"sensor_{job_name.replace('-', '_')}", "job_name": job_name,
              "execution": execution.rsplit("/", 1)[-1], "deferrable": deferrable, "mode": mode}
    path = write_dag_file(Path(conf.get("core", "dags_folder")), "sensor_dag", kwargs)
    try:
        dr = dag_factory.sensor_dag(**kwargs).test()
    finally:
        path.unlink(missing_ok=True)
    assert dr.get_task_instance("wait").state == TaskInstanceState.SUCCESS
    assert CAPTURED["summaries"][-1]["execution"] == execution


def test_a_failed_execution_is_classified_like_the_operator_does(gcp_conn, job_name):
    preempted = start(job_name, ["exit", "143"])
    with pytest.raises(CloudRunGpuFatalError, match=r"ended FAILED \(PREEMPTED\): task 0 attempt 1 \(exit code 143") as info:
        CloudRunGpuExecutionSensor(task_id="s", execution=preempted).poke({})
    assert (info.value.outcome, info.value.exit_code) == ("PREEMPTED", 143) and "Logs: http" in str(info.value)
    fatal = start(f"{job_name}-x", ["exit", "78"])
    with pytest.raises(CloudRunGpuFatalError, match="FATAL") as info:
        CloudRunGpuExecutionSensor(task_id="s", execution=fatal).poke({})
    assert info.value.exit_code == 78


def test_no_execution_means_the_jobs_newest(gcp_conn, job_name):
    start(job_name, ["exit", "1"])
    newest = start(job_name + "-n", ["ok"])  # another job: not picked
    ok = CloudRunGpuHook().run_job(job_name=job_name, region=REGION, project_id=PROJECT,
                                   overrides={"container_overrides": [{"args": ["ok"]}]})[1]
    CloudRunGpuHook().wait_for_execution(ok, poll_interval=0.1, timeout=30)
    result = CloudRunGpuExecutionSensor(task_id="s", job_name=job_name, region=REGION).poke({})
    assert result.is_done and result.xcom_value["execution"] == ok != newest
    assert result.xcom_value["outcome"] == "SUCCEEDED" and result.xcom_value["tasks"][0]["outcome"] == "SUCCEEDED"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idle = GpuJobSpec(name=f"{job_name}-idle", image=STUB_IMAGE, checkpoint_bucket=BUCKET)
    CloudRunGpuHook().create_job(job_name=idle.name, job=idle, region=REGION, project_id=PROJECT)
    with pytest.raises(ValueError, match="has no execution"):
        CloudRunGpuExecutionSensor(task_id="s", job_name=idle.name, region=REGION).poke({})


def test_a_preemption_cloud_run_still_retries_means_keep_waiting(gcp_conn, job_name, emulator):
    execution = start(job_name, ["sleep-first", "60", "1"], wait=False, max_retries=1)
    hook = CloudRunGpuHook()
    wait_until_running(hook, execution)
    emulator.preempt(execution, 0, 0.2)
    sensor = CloudRunGpuExecutionSensor(task_id="s", execution=execution)
    assert sensor.poke({}) is False  # attempt 0 preempted, attempt 1 pending or running
    hook.wait_for_execution(execution, poll_interval=0.1, timeout=30)
    result = sensor.poke({})
    assert result.is_done and result.xcom_value["tasks"][0]["attempts"] == 2

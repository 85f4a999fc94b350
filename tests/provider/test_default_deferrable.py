"""``[operators] default_deferrable`` is the default of ``deferrable`` (operator and sensor).

The option is read when the operator modules are imported (as the Google provider's operators
read it), so each setting runs in its own Python process: that process sets the option through
``AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE`` (or ``airflow.cfg``), builds an execute DAG and a
sensor DAG that do not pass ``deferrable``, runs both with ``dag.test()`` against the emulator and
counts how often the execution trigger ran: ``dag.test()`` runs a deferred task's trigger inline,
so a count above zero means the task deferred.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pendulum
import pytest

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.job_spec import GpuJobSpec
from tests.provider.conftest import BUCKET, PROJECT, REGION, STUB_IMAGE

REPO = Path(__file__).resolve().parents[2]
START = pendulum.datetime(2026, 1, 1, tz="UTC")

# One transport (gRPC, Cloud Run's default): what these tests tell apart is the option's effect
# on ``deferrable``, read at import and the same on either transport; each costs a fresh Airflow
# interpreter. The operator's and the sensor's deferred and waiting runs over both transports are
# tests/provider/operators/test_cloud_run.py's and tests/provider/sensors/test_cloud_run.py's.
pytestmark = [pytest.mark.usefixtures("airflow_db"), pytest.mark.parametrize("transport", ["grpc"], indirect=True)]


def execute_dag(dag_id: str, job_name: str):
    """``execute``: the execute operator, ``deferrable`` not given."""
    from airflow.providers.common.compat.sdk import DAG
    from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator

    with DAG(dag_id=dag_id, schedule=None, start_date=START, catchup=False) as dag:
        CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION, poll_interval=0.2)
    return dag


def sensor_dag(dag_id: str, job_name: str, execution: str):
    """``wait``: the execution sensor, ``deferrable`` not given."""
    from airflow.providers.common.compat.sdk import DAG
    from airflow_gpu_resilience.sensors.cloud_run import CloudRunGpuExecutionSensor

    with DAG(dag_id=dag_id, schedule=None, start_date=START, catchup=False) as dag:
        CloudRunGpuExecutionSensor(task_id="wait", execution=execution, job_name=job_name, region=REGION,
                                   poke_interval=0.2, timeout=60)
    return dag


#: Runs in a fresh interpreter: argv[1] is a JSON list of [factory, kwargs, task_id].
RUNNER = r"""
import json, sys
from pathlib import Path
from airflow.configuration import conf
from airflow_gpu_resilience.triggers.cloud_run import CloudRunGpuExecutionTrigger
from tests.provider import test_default_deferrable as factories

runs = []
original = CloudRunGpuExecutionTrigger.run

async def counted(self):
    runs.append(1)
    async for event in original(self):
        yield event

CloudRunGpuExecutionTrigger.run = counted
out = {}
for factory, kwargs, task_id in json.loads(sys.argv[1]):
    path = Path(conf.get("core", "dags_folder")) / f"{kwargs['dag_id']}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# airflow DAG\nimport json\nfrom tests.provider import test_default_deferrable as f\n"
                    f"dag = f.{factory}(**json.loads({json.dumps(json.dumps(kwargs))}))\n")
    try:
        dag = getattr(factories, factory)(**kwargs)
        before = len(runs)
        run = dag.test()
        out[task_id] = {"deferrable": dag.get_task(task_id).deferrable,
                        "state": str(run.get_task_instance(task_id).state).split(".")[-1].lower(),
                        "trigger_runs": len(runs) - before}
    finally:
        path.unlink(missing_ok=True)
print("RESULT " + json.dumps(out))
"""


def _deploy_and_start(job_name: str) -> str:
    """Deploy a job that exits 0 and start one execution of it; :return: the execution's name."""
    hook = CloudRunGpuHook()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = GpuJobSpec(name=job_name, image=STUB_IMAGE, args=["sleep", "0.5"], max_retries=0,
                          checkpoint_bucket=BUCKET)
    hook.create_job(job_name=job_name, job=spec, region=REGION, project_id=PROJECT)
    return hook.run_job(job_name=job_name, region=REGION, project_id=PROJECT)[1]


def _run(job_name: str, env: dict[str, str]) -> dict:
    execution = _deploy_and_start(job_name)
    stem = job_name.replace("-", "_")
    plan = [
        ["execute_dag", {"dag_id": f"dd_exec_{stem}", "job_name": job_name}, "execute"],
        ["sensor_dag", {"dag_id": f"dd_sensor_{stem}", "job_name": job_name, "execution": execution}, "wait"],
    ]
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(plan)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", None)
    env.update(extra)
    return env


def test_default_deferrable_true_makes_operator_and_sensor_defer(gcp_conn, job_name):
    result = _run(job_name, _env(AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE="True"))
    for task_id in ("execute", "wait"):
        assert result[task_id]["deferrable"] is True, result
        assert result[task_id]["trigger_runs"] >= 1, result
        assert result[task_id]["state"] == "success", result


def test_default_deferrable_false_set_by_the_deployment_makes_both_wait_in_the_worker(gcp_conn, job_name):
    result = _run(job_name, _env(AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE="False"))
    for task_id in ("execute", "wait"):
        assert result[task_id]["deferrable"] is False, result
        assert result[task_id]["trigger_runs"] == 0, result
        assert result[task_id]["state"] == "success", result


def test_default_deferrable_in_airflow_cfg_counts_as_set(gcp_conn, job_name, tmp_path):
    """The option written in ``airflow.cfg`` (not the environment) is the deployment's choice too."""
    cfg = tmp_path / "airflow.cfg"
    cfg.write_text("[operators]\ndefault_deferrable = True\n")
    result = _run(job_name, _env(AIRFLOW_CONFIG=str(cfg)))
    assert result["wait"]["deferrable"] is True and result["wait"]["trigger_runs"] >= 1, result


def test_unset_option_keeps_each_default(gcp_conn, job_name):
    """Without the option the execute operator defers (its jobs run for hours) and the sensor pokes."""
    result = _run(job_name, _env())
    assert result["execute"]["deferrable"] is True and result["execute"]["trigger_runs"] >= 1, result
    assert result["wait"]["deferrable"] is False and result["wait"]["trigger_runs"] == 0, result

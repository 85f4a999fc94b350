"""Fixtures and helpers the operator tests share: a factory DAG run with ``dag.test()``
(``run_dag``, ``run_execute``), the capture of summaries and errors cleared before each test, and
a stub job deployed to, and its executions listed from, the local Cloud Run emulator."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.job_spec import GpuJobSpec
from tests.provider.conftest import BUCKET, PROJECT, REGION, STUB_IMAGE
from tests.provider.operators import dag_factory
from tests.provider.operators.dag_factory import CAPTURED, write_dag_file


@pytest.fixture(autouse=True)
def _clear_captured():
    """Each test reads only the summaries and errors its own DAG runs captured."""
    CAPTURED["summaries"].clear()
    CAPTURED["errors"].clear()


@pytest.fixture
def run_dag():
    """Run a factory DAG with ``dag.test()``; its dags-folder twin is removed afterwards."""
    from airflow.configuration import conf

    written = []

    def run(factory: str, **kwargs):
        written.append(write_dag_file(Path(conf.get("core", "dags_folder")), factory, kwargs))
        return getattr(dag_factory, factory)(**kwargs).test()

    yield run
    for path in written:
        path.unlink(missing_ok=True)


def deploy(job_name: str, args: list[str], max_retries: int = 0, **kw) -> None:
    """Create job ``job_name`` running the stub image with ``args`` (see ``tests/provider/conftest.py``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = GpuJobSpec(name=job_name, image=STUB_IMAGE, args=args, max_retries=max_retries,
                          checkpoint_bucket=BUCKET, **kw)
    CloudRunGpuHook().create_job(job_name=job_name, job=spec, region=REGION, project_id=PROJECT)


@pytest.fixture
def run_execute(run_dag, job_name):
    """Run the execute DAG for ``job_name``; return its ``execute`` task instance."""

    def run(**kwargs):
        dr = run_dag("execute_dag", dag_id=f"exec_{job_name.replace('-', '_')}", job_name=job_name, **kwargs)
        return dr.get_task_instance("execute")

    return run


def executions(job_name: str) -> list:
    """The job's executions, newest first."""
    return CloudRunGpuHook().list_executions(job_name=job_name, region=REGION, project_id=PROJECT)

"""Console and Logs Explorer link builders."""

from __future__ import annotations

from urllib.parse import unquote

import pytest

from airflow_gpu_resilience.links.cloud_run import (
    CloudRunGpuExecutionLink,
    CloudRunGpuLogsLink,
    execution_console_url,
    logs_explorer_url,
)

NAME = "projects/proj-1/locations/europe-west4/jobs/train/executions/train-ab12c"


def test_console_url():
    assert execution_console_url(NAME) == (
        "https://console.cloud.google.com/run/jobs/executions/details/europe-west4/train-ab12c/tasks?project=proj-1"
    )


def test_logs_url_filters_on_the_execution():
    url = logs_explorer_url(NAME)
    assert url.startswith("https://console.cloud.google.com/logs/query;query=") and url.endswith("?project=proj-1")
    query = unquote(url.split("query=", 1)[1])
    assert 'resource.type="cloud_run_job"' in query and '"run.googleapis.com/execution_name"="train-ab12c"' in query


def test_logs_link_prefers_the_api_log_uri():
    assert CloudRunGpuLogsLink.url_for(NAME, "https://log/here") == "https://log/here"
    assert CloudRunGpuLogsLink.url_for(NAME) == logs_explorer_url(NAME)


def test_persist_pushes_the_url_under_the_link_key():
    pushed = {}

    class TI:
        def xcom_push(self, key, value):
            pushed[key] = value

    CloudRunGpuExecutionLink.persist({"ti": TI()}, execution=NAME)
    assert pushed == {CloudRunGpuExecutionLink().xcom_key: execution_console_url(NAME)}


def test_bad_name_is_rejected():
    with pytest.raises(ValueError, match="not a projects/"):
        execution_console_url("projects/p/locations/l/jobs/j")

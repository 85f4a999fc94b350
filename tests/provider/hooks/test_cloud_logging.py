"""The Cloud Logging reader against the emulator's ``entries:list``, with the real
``google-cloud-logging`` client (HTTP transport). Uses the session emulator; about 1 s."""

from __future__ import annotations

import datetime as dt
import json
import uuid

import pytest
from google.api_core import exceptions as gexc

from airflow_gpu_resilience.hooks.cloud_logging import CloudRunLogsHook, ExecutionLogFollower, execution_filter

from ..conftest import PROJECT

SINCE = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)  # the client's default window is the last 24 h


def _health(emulator) -> dict:
    import urllib.request

    with urllib.request.urlopen(emulator.endpoint + "/_emulator/health", timeout=10) as answer:
        return json.loads(answer.read())


@pytest.fixture
def execution(emulator):
    """A fake execution's attempt logs in the emulator's log folder: attempt 0 preempted, attempt 1 resumed."""
    short = f"job-{uuid.uuid4().hex[:6]}-abcde"
    folder = emulator.data_dir / "logs" / short
    folder.mkdir(parents=True)
    line = lambda sev, msg, t: json.dumps({"severity": sev, "message": msg, "time": f"2026-01-01T00:00:0{t}.000000Z"})  # noqa: E731
    (folder / "task0-attempt0.log").write_text(
        line("INFO", "training setup", 1) + "\n" + line("WARNING", "SIGTERM received; stopping at step 7", 2)
        + "\nTraceback (most recent call last): a text line\n")
    (folder / "task0-attempt1.log").write_text(line("INFO", "resuming from step 5", 4) + "\n")
    return f"projects/{PROJECT}/locations/us-central1/jobs/{short.rsplit('-', 1)[0]}/executions/{short}", folder


def test_each_line_once_across_reads_and_pages(gcp_conn, emulator, execution, monkeypatch):
    name, folder = execution
    follower = ExecutionLogFollower(CloudRunLogsHook(gcp_conn_id=gcp_conn), name, since=SINCE)
    monkeypatch.setattr(ExecutionLogFollower, "PAGE_SIZE", 2)  # 4 entries: two pages, one request each
    first = follower.read()
    assert [line.describe() for line in first] == [
        "task 0 attempt 0 INFO: training setup",
        "task 0 attempt 0 WARNING: SIGTERM received; stopping at step 7",
        "task 0 attempt 0 DEFAULT: Traceback (most recent call last): a text line",
        "task 0 attempt 1 INFO: resuming from step 5",
    ]
    assert follower.requests_made == 3  # 2 + 2 + an empty third page
    with (folder / "task0-attempt1.log").open("a") as log:
        log.write(json.dumps({"severity": "INFO", "message": "training complete", "time": "2026-01-01T00:00:04.000000Z"}) + "\n")
    assert [line.message for line in follower.drain()] == ["training complete"]  # same timestamp, new insertId
    assert follower.read() == []


def test_requests_stay_within_the_per_minute_budget(gcp_conn, emulator, execution):
    name, _ = execution
    now = [0.0]
    follower = ExecutionLogFollower(CloudRunLogsHook(gcp_conn_id=gcp_conn), name, max_requests_per_minute=2,
                                    since=SINCE, clock=lambda: now[0])
    before = _health(emulator)["loggingRequests"]
    assert len(follower.read()) == 4
    assert follower.read() == [] and _health(emulator)["loggingRequests"] == before + 1  # spaced: 30 s apart
    now[0] = 1.0
    assert follower.read(spaced=False) == [] and follower.read(spaced=False) == []
    assert _health(emulator)["loggingRequests"] == before + 2  # the minute's 2 requests are used up
    now[0] = 61.0
    follower.read()
    assert _health(emulator)["loggingRequests"] == before + 3


def test_bad_filter_and_bad_settings(gcp_conn, execution):
    hook = CloudRunLogsHook(gcp_conn_id=gcp_conn)
    with pytest.raises(gexc.BadRequest, match="unsupported clause"):
        list(hook.client(PROJECT).list_entries(resource_names=[f"projects/{PROJECT}"], filter_="textPayload:SIGTERM"))
    with pytest.raises(ValueError, match="execution="):
        execution_filter("job-x", None)
    with pytest.raises(ValueError, match="max_requests_per_minute"):
        ExecutionLogFollower(hook, execution[0], max_requests_per_minute=61)

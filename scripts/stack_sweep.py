"""A sweep on the local Airflow stack (:mod:`airflow_stack`): Cloud Run jobs whose one task runs
until the caller releases it, a DAG run of one mapped, deferrable execute task over them, and
what the REST API, the emulator and the logs say of that run.

The quota deployment test (``tests/deployment/test_quota_deployment.py``) and the watch-scale
benchmark's deployment mode (``benchmarks/watch_scale_deployment.py``) drive their sweeps with
these pieces.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

#: The message of Airflow 3's triggerer when its event loop did not run for longer than
#: ``[triggerer] blocked_main_thread_warning_threshold`` (default 0.2 s):
#: ``TriggerRunner.block_watchdog``, which sleeps 0.1 s and logs the time that sleep took.
BLOCKED_LOOP_MESSAGE = "Triggerer's async thread was blocked"
_BLOCKED = re.compile(r"^(\S+)\s.*" + re.escape(BLOCKED_LOOP_MESSAGE) + r" for ([0-9.]+) seconds")
#: How a triggerer names a trigger in its log lines: ``<dag>/<run>/<task>/<map index>/<try> (ID n)``.
_TRIGGER_NAME = re.compile(r"/(-?\d+)/\d+ \(ID \d+\)")


def wait_for(predicate: Callable, timeout: float, what: str, interval: float = 0.5):
    """Call ``predicate`` every ``interval`` s until it returns something truthy.

    :return: ``predicate()``'s first truthy value.
    :raises AssertionError: after ``timeout`` s, naming ``what`` was waited for.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def unpause_when_parsed(api, dag_id: str, timeout: float = 180) -> None:
    """Wait until the DAG processor has parsed ``dag_id`` (the REST API knows it), then unpause it.

    :param api: an ``airflow_client.client.ApiClient`` (:meth:`AirflowStack.api_client`).
    :raises AssertionError: not parsed within ``timeout`` s.
    """
    import airflow_client.client as client

    dags = client.DAGApi(api)

    def parsed():
        try:
            return dags.get_dag(dag_id)
        except client.ApiException:
            return None

    wait_for(parsed, timeout, f"the DAG processor to parse {dag_id}")
    dags.patch_dag(dag_id, client.DAGPatchBody(is_paused=False))


def state(value) -> Optional[str]:
    """:return: a REST API state (an enum or a string) as its plain string, ``None`` as ``None``."""
    return None if value is None else str(getattr(value, "value", value))


def mapped_task_instances(api, dag_id: str, run_id: str, task_id: str, page: int = 100) -> list:
    """Every mapped task instance of ``task_id`` in the DAG run, by map index (read in pages of
    ``page``, the REST API's default largest page)."""
    import airflow_client.client as client

    tis = client.TaskInstanceApi(api)
    found: list = []
    while True:
        batch = tis.get_mapped_task_instances(dag_id, run_id, task_id, limit=page, offset=len(found)).task_instances
        found += batch
        if len(batch) < page:
            return sorted(found, key=lambda ti: ti.map_index)


class ReleasableJobs:
    """Cloud Run jobs on the stack's emulator, one task each, whose container waits for a file
    that the caller creates (its release): the caller, not the clock, decides when each
    execution ends. A preempted task's retry waits for the same release.

    :param emulator: the stack's :class:`~cloud_run_emulator.process.EmulatorProcess`.
    :param project: the jobs' project; :param region: their region.
    :param names: the job ids.
    :param release_dir: the folder of the release files (created by :meth:`deploy`).
    :param check_seconds: how often a waiting task looks for its file (default 1 s).
    """

    def __init__(self, emulator, project: str, region: str, names: Iterable[str], release_dir: Path,
                 check_seconds: float = 1.0) -> None:
        self.emulator, self.project, self.region = emulator, project, region
        self.names = list(names)
        self.release_dir, self.check_seconds = Path(release_dir), check_seconds
        self.parent = f"projects/{project}/locations/{region}"

    def deploy(self, image: str, max_retries: int = 3, timeout_seconds: int = 1800) -> None:
        """Create every job (one task, ``max_retries``, the task timeout), all requests first,
        then wait for each operation: Admin API requests, which a quota counts."""
        from google.api_core.client_options import ClientOptions
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import run_v2

        self.release_dir.mkdir(parents=True, exist_ok=True)
        jobs = run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest",
                                 client_options=ClientOptions(api_endpoint=self.emulator.endpoint))
        operations = []
        for job in self.names:
            script = f'until [ -e "{self.release_dir / job}" ]; do sleep {self.check_seconds:g}; done'
            container = run_v2.Container(image=image, command=["/bin/sh", "-c", script])
            template = run_v2.ExecutionTemplate(task_count=1, template=run_v2.TaskTemplate(
                containers=[container], max_retries=max_retries, timeout=f"{timeout_seconds}s"))
            operations.append(jobs.create_job(parent=self.parent, job=run_v2.Job(template=template), job_id=job))
        for operation in operations:
            operation.result(timeout=120)

    def release(self, names: Iterable[str]) -> None:
        """Let these jobs' tasks end (exit 0) at their next look."""
        for job in names:
            (self.release_dir / job).touch()

    def execution_ids(self, job: str) -> list[str]:
        """The ids of the job's executions, from the emulator's log folders (no API request)."""
        pattern = re.compile(re.escape(job) + r"-[a-z0-9]{5}")
        logs = self.emulator.data_dir / "logs"
        return sorted(p.name for p in logs.iterdir() if pattern.fullmatch(p.name)) if logs.is_dir() else []

    def execution(self, job: str, timeout: float = 60) -> str:
        """The full name of the job's one execution, once it exists.

        :raises ValueError: the job has more than one execution.
        """
        [execution] = wait_for(lambda: self.execution_ids(job), timeout, f"the execution of {job}")
        return f"{self.parent}/jobs/{job}/executions/{execution}"

    def preempt(self, job: str, grace_seconds: float = 1.0) -> dict:
        """Maintenance-preempt the task of the job's execution (see ``EmulatorProcess.preempt``)."""
        return self.emulator.preempt(self.execution(job), task_index=0, grace_seconds=grace_seconds)


def configure_emulator(emulator, max_task_processes: int, read_quota_per_minute: int) -> dict:
    """Room for ``max_task_processes`` task processes at once, the read quota on, the request
    counters zeroed; :return: the settings that :func:`restore_emulator` puts back."""
    before = {"transitions": emulator._admin("POST", "/_emulator/transitions", {}),
              "quota": emulator._admin("GET", "/_emulator/quota", None)}
    emulator._admin("POST", "/_emulator/transitions", {"maxTaskProcesses": max_task_processes})
    set_read_quota(emulator, read_quota_per_minute)
    emulator.requests(reset=True)
    return before


def set_read_quota(emulator, per_minute: int) -> None:
    """The emulator's Admin API reads admitted per minute per project and region (0: off)."""
    emulator._admin("POST", "/_emulator/quota", {"readRequestsPerMinute": per_minute})


def restore_emulator(emulator, before: dict) -> None:
    """Put back what :func:`configure_emulator` changed."""
    set_read_quota(emulator, before["quota"]["readRequestsPerMinute"])
    emulator._admin("POST", "/_emulator/transitions",
                    {"maxTaskProcesses": before["transitions"]["maxTaskProcesses"]})


def region_requests(emulator, project: str, region: str) -> dict[str, dict]:
    """The emulator's Cloud Run API request counters of one project and region, per method:
    ``{method: {"requests": n, "quotaExceeded": m}}`` (admitted and rejected alike)."""
    return emulator.requests(project=project, region=region)["methods"]


def blocked_loop_warnings(log_text: str) -> list[tuple[float, float]]:
    """The triggerer's blocked-event-loop warnings in its log.

    :param log_text: the triggerer's log (``logs/triggerer.log`` of the stack).
    :return: ``(epoch seconds of the line, seconds Airflow says the loop was blocked)`` per
        warning; the seconds include its watchdog's 0.1 s sleep, so the block lay between that
        figure less 0.1 s and the figure.
    """
    found = []
    for line in log_text.splitlines():
        match = _BLOCKED.match(line)
        if match:
            found.append((_epoch(match.group(1)), float(match.group(2))))
    return found


def trigger_times(logs_dir: Path, dag_id: str, run_id: str, task_id: str) -> dict[int, dict]:
    """When each mapped task instance's trigger started and fired, from the trigger log files
    that the triggerer writes beside the task's (``.../map_index=I/attempt=T.log.trigger.J.log``).

    :return: ``{map index: {"start": epoch s, "fired": epoch s or None}}``, the first start and
        the first event over every triggerer that ran it.
    """
    folder = Path(logs_dir) / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
    times: dict[int, dict] = {}
    for path in sorted(folder.glob("map_index=*/attempt=*.log.trigger.*.log")):
        index = int(path.parent.name.split("=", 1)[1])
        mine = times.setdefault(index, {"start": None, "fired": None})
        for key, at in _trigger_log(path).items():
            if at is not None and (mine[key] is None or at < mine[key]):
                mine[key] = at
    return times


def trigger_starts(logs_dir: Path) -> list[float]:
    """Every trigger run's start in a deployment, over every DAG, run, task (mapped or not) and
    triggerer: each trigger log file's start line (see :func:`trigger_times`), in epoch seconds, sorted."""
    return sorted(at for path in Path(logs_dir).glob("dag_id=*/**/*.log.trigger.*.log")
                  if (at := _trigger_log(path)["start"]) is not None)


def _trigger_log(path: Path) -> dict:
    """One trigger log file's first start line and first event: ``{"start", "fired"}``, epoch s or ``None``."""
    found: dict = {"start": None, "fired": None}
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        event, at = str(record.get("event", "")), _epoch(record.get("timestamp", ""))
        key = ("start" if event.startswith("trigger ") and event.endswith(" starting") and
               _TRIGGER_NAME.search(event) else "fired" if event == "Trigger fired event" else None)
        if key and at is not None and (found[key] is None or at < found[key]):
            found[key] = at
    return found


def _epoch(stamp: str) -> Optional[float]:
    from datetime import datetime

    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None

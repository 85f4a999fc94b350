"""The emulated Cloud Run state: one :class:`CloudRunBackend` per (project, location).

Methods are named after the API verbs, take and return ``run_v2`` messages or models, and raise
:mod:`exceptions`; nothing here knows about HTTP. All backends of one :class:`Registry` share a
single ``threading.Condition``: every state change holds it, and waiters (WaitOperation) block
on it. Executions are run by :class:`~.supervisor.ExecutionSupervisor` threads.

Not emulated: IAM, ``validateOnly`` beyond validation, ``startExecutionToken`` and
``runExecutionToken``, ``showDeleted`` (deleted resources are dropped), DeleteExecution of a
running execution (rejected with FAILED_PRECONDITION), deleting a job that has running
executions (rejected with FAILED_PRECONDITION).
"""

from __future__ import annotations

import collections
import re
import secrets
import string
import threading
import time
import uuid
from typing import Optional

from google.cloud import run_v2

from . import validation
from .exceptions import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from .models import Execution, Job, Operation, Task, copy_message, utcnow
from .overrides import apply_overrides
from .runtime import RuntimeConfig
from .supervisor import ExecutionSupervisor

NAME = re.compile(r"^projects/(?P<p>[^/]+)/locations/(?P<l>[^/]+)(?:/|$)")
_ALNUM = string.ascii_lowercase + string.digits
#: Deleted executions whose attempt records a backend keeps (``/_emulator/attempts``), oldest dropped first.
DELETED_ATTEMPT_RECORDS = 1000


def paginate(items: list, page_size: int, page_token: str) -> tuple:
    """Offset paging: ``(page, next_page_token)``; the token is the next offset."""
    try:
        start = int(page_token or 0)
    except ValueError:
        raise InvalidArgument(f"page_token: invalid token '{page_token}'.") from None
    size = page_size if page_size > 0 else 100
    page = items[start:start + size]
    return page, (str(start + size) if start + size < len(items) else "")


class Registry:
    """All backends of one emulator, created on first use.

    :param config: runtime settings for the supervisors.
    :param public_endpoint: ``http://127.0.0.1:PORT``, used in ``logUri``.
    """

    def __init__(self, config: RuntimeConfig, public_endpoint: str) -> None:
        self.config = config
        self.public_endpoint = public_endpoint
        self.cond = threading.Condition(threading.RLock())
        self._backends: dict = {}

    def for_name(self, name: str, field: str = "name") -> "CloudRunBackend":
        """The backend owning a resource (or parent) name ``projects/P/locations/L/...``.

        :param name: the resource or parent name.
        :param field: the request field that carried it, for error messages.
        :raises InvalidArgument: naming ``field``, when the name is not of that form or its
            project id or location breaks Cloud Run's rules (see :mod:`.validation`).
        """
        match = NAME.match(name)
        if not match:
            raise InvalidArgument(f"{field}: '{name}' is not of the form projects/*/locations/*/...")
        key = (match.group("p"), match.group("l"))
        validation.validate_project_location(*key, field)
        with self.cond:
            if key not in self._backends:
                self._backends[key] = CloudRunBackend(*key, registry=self)
            return self._backends[key]

    def backends(self) -> list:
        with self.cond:
            return list(self._backends.values())

    def preemptible(self, prefix: str = "") -> list:
        """``[(supervisor, task_index, attempt)]`` of running attempts not already being stopped
        whose task name starts with ``prefix``, sorted by task name (for seeded picks)."""
        with self.cond:
            found = [(s, i, a) for b in self._backends.values() for s in b.supervisors.values()
                     for i, a in s.running.items() if a.stop_reason is None and a.task.name.startswith(prefix)]
        return sorted(found, key=lambda item: item[2].task.name)

    def shutdown(self, grace: float = 2.0) -> None:
        """Stop every supervisor: SIGTERM all attempts, SIGKILL what is left after ``grace``
        seconds, reap them."""
        with self.cond:
            supervisors = [s for b in self._backends.values() for s in b.supervisors.values()]
            for supervisor in supervisors:
                supervisor.terminate()
            deadline = time.monotonic() + grace
            for supervisor in supervisors:
                supervisor.reap(deadline)

    def reset(self) -> None:
        """Stop everything and forget all resources."""
        self.shutdown()
        with self.cond:
            self._backends.clear()


class CloudRunBackend:
    """Jobs, executions, tasks and operations of one project and location.

    :param project: project id as it appears in names.
    :param location: region as it appears in names.
    :param registry: the owning :class:`Registry` (lock, config, endpoint).
    """

    def __init__(self, project: str, location: str, registry: Registry) -> None:
        self.parent = f"projects/{project}/locations/{location}"
        self.registry = registry
        self.cond = registry.cond
        self.jobs: dict = {}
        self.executions: dict = {}
        self.operations: dict = {}
        self.supervisors: dict = {}
        #: The attempt records of deleted executions, newest last, at most
        #: :data:`DELETED_ATTEMPT_RECORDS` executions: a job's cleanup must not erase what ran.
        self.deleted_attempts: collections.OrderedDict = collections.OrderedDict()

    # --- helpers -------------------------------------------------------------------------
    def _new_operation(self, target, done: bool, keep: bool = True) -> Operation:
        """A new operation on ``target``; ``keep=False`` (validateOnly) leaves it unstored."""
        op = Operation(name=f"{self.parent}/operations/{uuid.uuid4()}", target=target, done=done)
        if keep:
            self.operations[op.name] = op
        return op

    def _get(self, store: dict, name: str, kind: str):
        if name not in store:
            raise NotFound(f"Resource '{name}' of kind '{kind}' was not found.")
        return store[name]

    @staticmethod
    def _check_etag(resource, etag: str) -> None:
        if etag and etag != resource.etag:
            raise FailedPrecondition(f"etag: '{etag}' does not match the current etag {resource.etag}.")

    def _validate(self, job: run_v2.Job) -> int:
        return validation.validate_job(job, self.registry.config.gcs.bucket_exists)

    @staticmethod
    def _fill_defaults(job: run_v2.Job) -> None:
        template = job.template
        if template.task_count == 0:
            template.task_count = 1
        if "max_retries" not in template.template:
            template.template.max_retries = 3
        if "timeout" not in template.template:
            template.template.timeout = {"seconds": 600}
        job.launch_stage = 0

    # --- jobs ----------------------------------------------------------------------------
    def create_job(self, job_id: str, job: run_v2.Job, validate_only: bool = False) -> Operation:
        """CreateJob; the operation is done at once with response=Job."""
        validation.validate_job_id(job_id)
        name = f"{self.parent}/jobs/{job_id}"
        with self.cond:
            if name in self.jobs:
                raise AlreadyExists(f"Resource '{name}' already exists.")
            stage = self._validate(job)
            spec = copy_message(job)
            self._fill_defaults(spec)
            model = Job(name=name, spec=spec, launch_stage=stage, create_time=utcnow())
            if validate_only:
                return self._new_operation(model, done=True, keep=False)
            self.jobs[name] = model
            return self._new_operation(model, done=True)

    def get_job(self, name: str) -> Job:
        with self.cond:
            return self._get(self.jobs, name, "Job")

    def list_jobs(self, page_size: int = 0, page_token: str = "") -> tuple:
        """Jobs newest first: ``(jobs, next_page_token)``."""
        with self.cond:
            items = sorted(self.jobs.values(), key=lambda j: j.create_time, reverse=True)
            return paginate(items, page_size, page_token)

    def update_job(self, job: run_v2.Job, allow_missing: bool = False, validate_only: bool = False) -> Operation:
        """UpdateJob: the whole spec is replaced (there is no update mask); generation bumps."""
        with self.cond:
            if job.name not in self.jobs:
                if not allow_missing:
                    raise NotFound(f"Resource '{job.name}' of kind 'Job' was not found.")
                return self.create_job(job.name.rsplit("/", 1)[-1], job, validate_only)
            model = self.jobs[job.name]
            self._check_etag(model, job.etag)
            stage = self._validate(job)
            if validate_only:
                return self._new_operation(model, done=True, keep=False)
            spec = copy_message(job)
            self._fill_defaults(spec)
            model.spec, model.launch_stage = spec, stage
            model.generation += 1
            model.update_time = utcnow()
            return self._new_operation(model, done=True)

    def delete_job(self, name: str, etag: str = "", validate_only: bool = False) -> Operation:
        """DeleteJob; its executions go with it. Refused while an execution runs."""
        with self.cond:
            model = self._get(self.jobs, name, "Job")
            self._check_etag(model, etag)
            running = [e for e in self.executions.values() if e.job_name == name and not e.done]
            if running:
                raise FailedPrecondition(f"Job '{name}' has a running execution: {running[0].name}.")
            if validate_only:
                return self._new_operation(model, done=True, keep=False)
            model.delete_time = utcnow()
            del self.jobs[name]
            for ex_name in [n for n, e in self.executions.items() if e.job_name == name]:
                self._forget_execution(ex_name)
            return self._new_operation(model, done=True)

    # --- run ------------------------------------------------------------------------------
    def run_job(self, name: str, etag: str = "", overrides: Optional[run_v2.RunJobRequest.Overrides] = None,
                validate_only: bool = False) -> Operation:
        """RunJob: create an execution and its tasks, start its supervisor.

        The operation stays ``done=false`` (metadata=Execution) until the execution finishes;
        then response=Execution, or ``error`` when a task failed for good. A cancelled
        execution finishes with a response and no error, as Cloud Run does.
        """
        with self.cond:
            job = self._get(self.jobs, name, "Job")
            self._check_etag(job, etag)
            template, task_count = apply_overrides(job.spec.template, overrides)
            preview = validation.validate_task_template(template, self.registry.config.gcs.bucket_exists)
            if preview and job.launch_stage not in validation.PREVIEW:  # e.g. a GPU timeout override over 1 h
                raise InvalidArgument(f"overrides: {preview} is a Preview feature, and the job's launch stage is GA; "
                                      "deploy it with launch_stage ALPHA or BETA.")
            execution = self._new_execution(job, template, task_count)
            if validate_only:
                return self._new_operation(execution, done=True, keep=False)
            self.executions[execution.name] = execution
            job.execution_count += 1
            job.latest = execution
            op = self._new_operation(execution, done=False)
            supervisor = ExecutionSupervisor(
                execution, self.registry.config, self.cond, lambda ex: self._on_finish(op, ex),
                self._gpu_slots_left)
            self.supervisors[execution.name] = supervisor
            supervisor.start()
            return op

    def _gpu_slots_left(self) -> int:
        """GPU attempts that may still start here under ``gpu_quota`` (a large number if unlimited)."""
        quota = self.registry.config.policy.gpu_quota
        if quota <= 0:
            return 1 << 30
        return quota - sum(len(s.running) + len(s.starting) for s in self.supervisors.values() if s.gpu)

    def _on_finish(self, op: Operation, execution: Execution) -> None:
        op.done = True
        if execution.failure_message and execution.state.name == "FAILED":
            code = 13 if execution.failure_internal else self.registry.config.policy.failed_execution_code
            op.error = (code, execution.failure_message)

    def _new_execution(self, job: Job, template: run_v2.TaskTemplate, task_count: int) -> Execution:
        short_job = job.name.rsplit("/", 1)[-1]
        short = f"{short_job}-{''.join(secrets.choice(_ALNUM) for _ in range(5))}"
        name = f"{job.name}/executions/{short}"
        logs = f"{self.registry.public_endpoint}/_emulator/logs/{name}"
        now = utcnow()
        execution = Execution(
            name=name, job=short_job, job_name=job.name, template=template, task_count=task_count,
            parallelism=job.spec.template.parallelism, launch_stage=job.launch_stage,
            labels=dict(job.spec.template.labels), create_time=now, log_uri=logs)
        timeout_s = validation.timeout_seconds(template)
        execution.tasks = [
            Task(name=f"{name}/tasks/{short}-task{i}", index=i, job=short_job, execution=short,
                 template=template, max_retries=template.max_retries, timeout_s=timeout_s,
                 create_time=now, log_uri=f"{logs}/tasks/{short}-task{i}",
                 not_before=time.monotonic() + self.registry.config.policy.start_delay_seconds)
            for i in range(task_count)
        ]
        return execution

    # --- executions ----------------------------------------------------------------------
    def get_execution(self, name: str) -> Execution:
        with self.cond:
            return self._get(self.executions, name, "Execution")

    def list_executions(self, parent: str, page_size: int = 0, page_token: str = "") -> tuple:
        """Executions of a job (``jobs/-``: of all jobs), newest first."""
        with self.cond:
            items = [e for e in self.executions.values() if parent.endswith("/jobs/-") or e.job_name == parent]
            if not parent.endswith("/jobs/-") and parent not in self.jobs:
                raise NotFound(f"Resource '{parent}' of kind 'Job' was not found.")
            items.sort(key=lambda e: e.create_time, reverse=True)
            return paginate(items, page_size, page_token)

    def cancel_execution(self, name: str, etag: str = "", validate_only: bool = False) -> Operation:
        """CancelExecution: its operation is done once the execution is CANCELLED (or already
        terminal, in which case nothing changes)."""
        with self.cond:
            execution = self._get(self.executions, name, "Execution")
            self._check_etag(execution, etag)
            if validate_only or execution.done:
                return self._new_operation(execution, done=True)
            op = self._new_operation(execution, done=False)
            supervisor = self.supervisors[name]
            supervisor.request_cancel()
            supervisor.finish_callbacks.append(lambda _ex: setattr(op, "done", True))
            self.cond.notify_all()
            return op

    def delete_execution(self, name: str, etag: str = "", validate_only: bool = False) -> Operation:
        """DeleteExecution of a finished execution; a running one is refused."""
        with self.cond:
            execution = self._get(self.executions, name, "Execution")
            self._check_etag(execution, etag)
            if not execution.done:
                raise FailedPrecondition(f"Execution '{name}' is still running; cancel it first.")
            if not validate_only:
                self._forget_execution(name)
            return self._new_operation(execution, done=True)

    # --- tasks ---------------------------------------------------------------------------
    def get_task(self, name: str) -> Task:
        with self.cond:
            execution_name = name.split("/tasks/", 1)[0]
            if execution_name in self.executions:
                for task in self.executions[execution_name].tasks:
                    if task.name == name:
                        return task
            raise NotFound(f"Resource '{name}' of kind 'Task' was not found.")

    def list_tasks(self, parent: str, page_size: int = 0, page_token: str = "") -> tuple:
        """Tasks of an execution by index; ``jobs/-`` and ``executions/-`` are wildcards."""
        pattern = re.compile("^" + "/".join(
            "[^/]+" if seg == "-" else re.escape(seg) for seg in parent.split("/")) + "$")
        with self.cond:
            matched = [e for n, e in self.executions.items() if pattern.match(n)]
            if not matched and "/-" not in parent:
                raise NotFound(f"Resource '{parent}' of kind 'Execution' was not found.")
            matched.sort(key=lambda e: e.create_time, reverse=True)
            return paginate([t for e in matched for t in e.tasks], page_size, page_token)

    # --- operations ----------------------------------------------------------------------
    def get_operation(self, name: str) -> Operation:
        with self.cond:
            return self._get(self.operations, name, "Operation")

    def list_operations(self, page_size: int = 0, page_token: str = "") -> tuple:
        with self.cond:
            items = sorted(self.operations.values(), key=lambda o: o.create_time, reverse=True)
            return paginate(items, page_size, page_token)

    def wait_operation(self, name: str, timeout_s: float) -> Operation:
        """Block until the operation is done or ``timeout_s`` seconds pass."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            op = self._get(self.operations, name, "Operation")
            while not op.done and time.monotonic() < deadline:
                self.cond.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            return op

    def delete_operation(self, name: str) -> None:
        with self.cond:
            self._get(self.operations, name, "Operation")
            del self.operations[name]

    def _forget_execution(self, name: str) -> None:
        """Delete an execution, keeping its attempt records (see :attr:`deleted_attempts`)."""
        execution = self.executions.pop(name)
        self.supervisors.pop(name, None)
        self.deleted_attempts[name] = [{"task": t.name, "index": t.index, **entry}
                                       for t in execution.tasks for entry in t.history]
        while len(self.deleted_attempts) > DELETED_ATTEMPT_RECORDS:
            self.deleted_attempts.popitem(last=False)

    def attempts(self, name: str) -> list:
        """Every ended attempt of an execution's tasks (or of one task, given a task name), by
        task index and attempt: the task's name and index plus its history entry. A deleted
        execution's records stay readable (the last :data:`DELETED_ATTEMPT_RECORDS` executions),
        as a billing record outlives the resource."""
        with self.cond:
            execution_name, _, _ = name.partition("/tasks/")
            if execution_name not in self.executions and execution_name in self.deleted_attempts:
                return [dict(r) for r in self.deleted_attempts[execution_name] if "/tasks/" not in name or r["task"] == name]
            execution = self._get(self.executions, execution_name, "Execution")
            tasks = [self.get_task(name)] if "/tasks/" in name else execution.tasks
            return [{"task": t.name, "index": t.index, **entry} for t in tasks for entry in t.history]

    # --- faults and lifecycle ------------------------------------------------------------
    def preempt(self, execution_name: str, index: int, grace_s: float, wait_s: float = 10.0) -> dict:
        """Simulate maintenance on task ``index``: SIGTERM its running attempt, SIGKILL after
        ``grace_s``; the attempt fails with the preemption status and is retried per maxRetries.
        Waits up to ``wait_s`` seconds for the task to be running.
        """
        deadline = time.monotonic() + wait_s
        with self.cond:
            execution = self._get(self.executions, execution_name, "Execution")
            if not 0 <= index < execution.task_count:
                raise InvalidArgument(f"taskIndex: {index} is out of range for {execution.task_count} task(s).")
            supervisor = self.supervisors[execution_name]
            while index not in supervisor.running or supervisor.running[index].stop_reason:
                if execution.done or time.monotonic() >= deadline:
                    raise FailedPrecondition(f"Task {index} of '{execution_name}' is not running.")
                self.cond.wait(timeout=0.1)
            attempt = supervisor.preempt(index, grace_s)
            return {"task": attempt.task.name, "attempt": attempt.number, "pid": attempt.popen.pid}

"""The run manager: attach to or start a task instance's execution, wait for it, act on its outcome.

:class:`CloudRunGpuRunManager` does for the execute operator what ``pod_manager`` does for cncf.kubernetes'
pod operator: the operator keeps Airflow's side (``context``, XCom, links, deferral) and hands the manager
what it needs, a hook, the checked :class:`RunSettings` and two callbacks; the manager attaches, starts,
polls, classifies and re-runs through the hook and decides with :mod:`~airflow_gpu_resilience.outcome`.

**The goodput account** of the try (:mod:`~airflow_gpu_resilience.goodput`) is logged as a table when the
task ends: on success it is the summary's ``goodput``; on a failure (and an overall ``timeout``) it is built
before raising, its headline ends the error's message and the error carries it (a failure on an execution's
outcome also hands it to ``on_failure_goodput``, the ``goodput`` XCom). Building it never raises.

**The re-run budget follows checkpoint progress** when ``checkpoint_bucket`` is set
(:mod:`~airflow_gpu_resilience.rerun_budget`): a re-run after an execution in which any task
committed a newer checkpoint is free; ``max_reruns_without_progress`` re-runs in a row without
one end the task (:class:`~airflow_gpu_resilience.exceptions.CloudRunGpuFatalError` naming the
step it is stuck at); ``max_total_reruns`` caps them all, for cost. The steps at each
execution's start are kept on the execution (``AIRFLOW_GPU_RESILIENCE_START_STEPS``), so every
try reads the same history from Cloud Run and the bucket. A read of the bucket that fails is
retried for ``progress_read_timeout``; after that the newest execution's progress is unknown,
which is neither progress nor no progress (at most ``max_preemption_reruns`` such executions are
passed over). Without ``checkpoint_bucket`` the fixed budget ``max_preemption_reruns`` applies
instead, and the log says so. A task timeout is re-run like a preemption.

**State lives in Cloud Run, not in the operator.** Every execution carries container env
vars: ``AIRFLOW_GPU_RESILIENCE_RUN_KEY`` (a hash of dag id, run id, task id and map index,
the same for every try), ``AIRFLOW_GPU_RESILIENCE_RERUN`` (``0`` for the first execution
of a try, ``n`` for the n-th preemption re-run) and ``AIRFLOW_GPU_RESILIENCE_START_ID``
(one per RunJob request, so that a RunJob whose answer was lost is not sent twice). A new
try (Airflow retry, worker restart) first attaches to a still-running execution with its run
key instead of starting another; an execution that finished while no try was waiting (after
``wait_timeout``) is adopted if it succeeded or was only preempted. The preemption budget
counts the re-run executions with that key: it is shared by all tries of the task instance.
This holds after a clear of the task too: a cleared task whose newest execution succeeded
returns that execution's summary without running the job again (trigger a new DAG run to
run it again), and a cleared task shares the budget (raise ``max_preemption_reruns`` to give
it more).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from google.api_core import exceptions as gexc
from google.cloud import run_v2

from airflow_gpu_resilience.exceptions import (
    CloudRunGpuExecutionError,
    CloudRunGpuFatalError,
    CloudRunGpuTimeoutError,
    CloudRunGpuWaitTimeout,
)
from airflow_gpu_resilience.hooks.cloud_logging import CloudRunLogsHook, ExecutionLogFollower
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.overrides import execution_env, with_env_overrides
from airflow_gpu_resilience.hooks.progress import CheckpointFilesHook
from airflow_gpu_resilience.operators.goodput_report import GoodputReport, build_report
from airflow_gpu_resilience.outcome import (
    RESUMABLE,
    Action,
    AttemptLog,
    ExecutionState,
    OutcomeClass,
    TaskOutcome,
    classify_task,
    decide,
    execution_state,
)
from airflow_gpu_resilience.rerun_budget import ExecutionProgress, ProgressBudget
from airflow_gpu_resilience.run_progress import MAX_PROGRESS_TASKS, CheckpointProgress, job_env, progress_history
from airflow_gpu_resilience.run_state import (
    RERUN_ENV,
    RUN_KEY_ENV,
    START_STEPS_ENV,
    AttemptEntry,
    RunSettings,
    RunState,
    RunStep,
    RunSummary,
    chain_entries,
    encode_steps,
)
from airflow_gpu_resilience.triggers.cloud_run import ExecutionEventStatus

__all__ = ["CloudRunGpuRunManager"]


class CloudRunGpuRunManager:
    """Attach, start, wait, classify and re-run the executions of one Airflow task instance.

    Takes no Airflow ``context``: what the operator publishes (XCom, links) goes through the callbacks.

    :param hook: the Cloud Run hook (every Cloud Run call goes through it).
    :param settings: the operator's checked arguments.
    :param log: the logger of the task (the operator's ``log``).
    :param on_execution: called with ``(execution name, log URI)`` for every execution started or
        attached to (default: nothing).
    :param on_failure_goodput: called with the goodput account of a try that fails on an
        execution's outcome, before the error is raised (default: nothing).
    """

    def __init__(
        self,
        hook: CloudRunGpuHook,
        settings: RunSettings,
        *,
        log: logging.Logger | logging.LoggerAdapter,
        on_execution: Callable[[str, str], None] = lambda *_: None,
        on_failure_goodput: Callable[[GoodputReport], None] = lambda *_: None,
    ) -> None:
        self.hook, self.settings, self.log = hook, settings, log
        self._on_execution, self._on_failure_goodput = on_execution, on_failure_goodput
        #: The execution being waited for (``on_kill`` cancels it), ``None`` when none is.
        self.running_execution: str | None = None
        self._last_progress_log = float("-inf")
        self._log_follower: ExecutionLogFollower | None = None
        self._project: str | None = None  # the job's project, once a run names it
        #: The checkpoint bucket's reader, ``None`` without ``checkpoint_bucket``.
        self.progress: CheckpointProgress | None = None
        if settings.checkpoint_bucket:
            files = CheckpointFilesHook(settings.checkpoint_bucket, settings.checkpoint_prefix or settings.job_name,
                                        gcp_conn_id=settings.gcp_conn_id,
                                        impersonation_chain=settings.impersonation_chain)
            self.progress = CheckpointProgress(files, log, None if settings.checkpoint_prefix else lambda: job_env(
                hook, settings.job_name, settings.region, settings.overrides, self._project))

    def new_run(self, project_id: str, run_key: str, deadline: float | None) -> RunState:
        """A new try's state, with the settings' re-run limits; the log says which budget applies.

        :param project_id: the Google Cloud project of the job.
        :param run_key: the task instance's run key (the same for all its tries).
        :param deadline: epoch seconds when the try's overall ``timeout`` passes, or ``None``.
        """
        self._project = project_id
        run = RunState(project_id=project_id, run_key=run_key, budget=self.settings.max_preemption_reruns,
                       deadline=deadline, max_reruns_without_progress=self.settings.max_reruns_without_progress,
                       max_total_reruns=self.settings.max_total_reruns)
        self._announce(run)
        return run

    def _announce(self, run: RunState) -> None:
        """Log which re-run budget applies: checkpoint progress, or the fixed one without a bucket."""
        if self.settings.checkpoint_bucket:
            self.log.info("Re-runs follow checkpoint progress in gs://%s: max_reruns_without_progress=%s, "
                          "max_total_reruns=%s", self.settings.checkpoint_bucket, run.max_reruns_without_progress,
                          run.max_total_reruns)
        else:
            self.log.info("No checkpoint_bucket: checkpoint progress cannot be read, so the fixed budget "
                          "max_preemption_reruns=%s applies to re-runs", run.budget)

    # --- starting or attaching -------------------------------------------------------------
    def attach_or_start(self, run: RunState) -> RunStep:
        """Carry on with an earlier try's newest execution, or start one.

        A still-running execution is attached to. A finished one that no try has acted on yet
        (it ended after a try gave up waiting) is adopted when it succeeded or only lost tasks to
        preemptions or task timeouts: the run is done, it is re-run, or the budget is reported
        exhausted. A FAILED, FATAL or CANCELLED one was already acted on (the earlier try
        raised): a new execution starts.

        :param run: this try's state.
        :return: the execution to wait for, or the summary of an adopted one.
        """
        found = self._find_own(run)
        newest = found[0] if found else None
        if newest is not None and execution_state(newest) is ExecutionState.RUNNING:
            self.log.info("Attaching to execution %s started by an earlier try", newest.name)
            self._remember(newest.name)
            return RunStep.wait(newest.name)
        if newest is not None and self._adoptable(run, newest, found):
            self.log.info("Adopting execution %s: it finished while no try was waiting", newest.name)
            self._remember(newest.name)
            return self.after_finish(run, newest.name, AttemptLog())
        return RunStep.wait(self.start(run, rerun=0, steps=self._read_steps(run)))

    def _find_own(self, run: RunState) -> list[run_v2.Execution]:
        """The executions of this task instance (its run key), newest first."""
        return self.hook.find_executions(job_name=self.settings.job_name, region=self.settings.region,
                                         env={RUN_KEY_ENV: run.run_key}, project_id=run.project_id)

    def _adoptable(self, run: RunState, execution: run_v2.Execution, own: list[run_v2.Execution]) -> bool:
        tasks = self.hook.list_tasks(execution=execution.name)
        decision = decide([classify_task(t, self.settings.fatal_exit_codes) for t in tasks],
                          state=execution_state(execution), reruns_used=reruns_used(own), max_reruns=run.budget)
        # A FAILED, FATAL or CANCELLED outcome was raised by an earlier try; the others never are
        # before the decision is acted on (a re-run, a summary, or "budget exhausted").
        return decision.outcome in (OutcomeClass.SUCCEEDED, *RESUMABLE)

    def start(self, run: RunState, rerun: int, steps: Mapping[int, int] | None) -> str:
        """Start an execution of the task instance, recording its run key, re-run number and steps.

        :param run: this try's state.
        :param rerun: 0 for a try's first execution, ``n`` for the n-th re-run.
        :param steps: the committed checkpoint steps now (``None``: unknown or no bucket, not recorded).
        :return: the full execution name.
        """
        env = {RUN_KEY_ENV: run.run_key, RERUN_ENV: str(rerun)}  # start_execution adds TASK_TIMEOUT_SECONDS
        if steps is not None:  # the progress record lives on the execution, for every later try
            env[START_STEPS_ENV] = encode_steps(steps)
        name = self.hook.start_execution(
            job_name=self.settings.job_name, region=self.settings.region, project_id=run.project_id,
            overrides=with_env_overrides(self.settings.overrides, env),
        )
        self.log.info("Started execution %s%s", name, f" (preemption re-run {rerun})" if rerun else "")
        self._remember(name)
        return name

    def _remember(self, name: str) -> None:
        self.running_execution = name
        self._on_execution(name, self.hook.get_execution(execution=name).log_uri)

    # --- waiting ---------------------------------------------------------------------------
    def poll_until_done(self, run: RunState, execution: str) -> AttemptLog:
        """Block until ``execution`` finishes, logging progress and container lines while polling.

        :return: the finished attempts seen while polling.
        :raises CloudRunGpuWaitTimeout: ``wait_timeout`` passed.
        :raises CloudRunGpuTimeoutError: the overall deadline passed; the execution was cancelled.
        """
        limit = run.next_wait(self.settings.wait_timeout, time.time())
        attempts = AttemptLog()

        def log_progress(current: run_v2.Execution, tasks: list[run_v2.Task]) -> None:
            self.copy_container_logs(execution)
            if (self.progress is not None
                    and time.monotonic() - self._last_progress_log >= self.settings.progress_log_interval):
                self._last_progress_log = time.monotonic()
                self.progress.log_progress(run, current.task_count)

        try:
            self.hook.wait_for_execution(execution, poll_interval=self.settings.poll_interval, timeout=limit,
                                         on_poll=log_progress, attempts=attempts)
        except TimeoutError:
            self.timed_out(run, execution, f"still running after {limit:g} s")
        return attempts

    def run_to_end(self, run: RunState, step: RunStep) -> RunSummary:
        """Poll until the run is done, re-running after preemptions (waiting in the worker).

        :param run: this try's state.
        :param step: the execution to wait for first (or the summary, returned at once).
        :return: the summary; raises as :meth:`poll_until_done` and :meth:`after_finish` do.
        """
        while step.execution is not None:
            step = self.after_finish(run, step.execution, self.poll_until_done(run, step.execution))
        assert step.summary is not None
        return step.summary

    def resume(self, run: RunState, event: Mapping[str, Any]) -> RunStep:
        """Act on the trigger's event for the execution it waited for.

        :param run: the state deferred with (the event's ``carry``).
        :param event: the trigger's event (see
            :class:`~airflow_gpu_resilience.triggers.cloud_run.CloudRunGpuExecutionTrigger`).
        :return: the next step; raises as :meth:`timed_out` and :meth:`after_finish` do, and
            :class:`CloudRunGpuExecutionError` when the trigger hit an API error.
        """
        execution, status = event["execution"], event["status"]
        self.running_execution, self._project = execution, run.project_id
        if self.progress is not None:
            self.progress.log_progress(run, int(self.hook.get_execution(execution=execution).task_count))
        if status == ExecutionEventStatus.TIMEOUT.value:
            self.timed_out(run, execution, event["message"])
        if status == ExecutionEventStatus.ERROR.value:
            raise CloudRunGpuExecutionError(f"Polling {execution} failed: {event['message']}", execution=execution)
        return self.after_finish(run, execution, AttemptLog.from_dicts(event.get("attempts") or []))

    def timed_out(self, run: RunState, execution: str, message: str) -> NoReturn:
        """Raise for a wait that hit its limit; cancel the execution if it was the overall ``timeout``.

        :raises CloudRunGpuWaitTimeout: the wait was ``wait_timeout`` (retryable; not cancelled).
        :raises CloudRunGpuTimeoutError: the wait was the overall deadline; the execution was cancelled.
        """
        self.running_execution = None
        if not run.overall_limit:
            raise CloudRunGpuWaitTimeout(f"Execution {execution} {message}", execution=execution)
        self.log.warning("Overall timeout passed: cancelling execution %s", execution)
        try:
            self.hook.cancel_execution(execution=execution)
        except gexc.NotFound as exc:  # deleted meanwhile; a finished one is returned unchanged
            self.log.info("Cancel of %s not needed: %s", execution, exc)
        report = self.goodput(run, failed=True, also=execution)
        raise CloudRunGpuTimeoutError(
            f"The task's overall timeout passed: execution {execution} {message} and was cancelled "
            f"({len(run.executions)} earlier execution(s) in this try)."
            + (f" {report['headline']}" if report else ""),
            execution=execution, goodput=report,
        )

    # --- acting on a finished execution ----------------------------------------------------
    def after_finish(self, run: RunState, execution: str, attempts: AttemptLog) -> RunStep:
        """Record the finished execution and act on the decision: done, a re-run to wait for, or raise.

        :param run: this try's state (the execution is added to it).
        :param execution: the finished execution's full name.
        :param attempts: its attempts seen while polling (the last ones are added here).
        :return: the summary, or the re-run to wait for.
        :raises CloudRunGpuExecutionError: a task FAILED.
        :raises CloudRunGpuFatalError: FATAL (with the worker's reason when its files give one, see
            :meth:`CheckpointProgress.worker_reasons`), cancelled, or the re-run budget is exhausted.
        """
        self.copy_container_logs(execution, finished=True)
        finished = self.hook.get_execution(execution=execution)
        tasks = self.hook.list_tasks(execution=execution)
        attempts.observe(tasks)
        outcomes = [classify_task(t, self.settings.fatal_exit_codes) for t in tasks]
        if self.progress is not None:  # from the worker's files: a non-retryable stop's reason, unseen attempts
            outcomes = self.progress.worker_reasons(outcomes, timeout=self.settings.progress_read_timeout)
            self.progress.tell_unobserved(execution, attempts, tasks)
        own = self._find_own(run)  # one listing for the re-run count and the progress history
        used = reruns_used(own)
        run.classes[execution] = _execution_class(outcomes, execution_state(finished)).value
        history, now = self.history(run, own)
        progress = None if history is None else ProgressBudget(
            history, run.max_reruns_without_progress, run.max_total_reruns, max_unknown_progress=run.budget)
        decision = decide(outcomes, state=execution_state(finished), reruns_used=used, max_reruns=run.budget,
                          progress=progress)
        for entry in run.add_execution(finished, outcomes, attempts, decision, self.settings.fatal_exit_codes):
            self._log_attempt(entry)
        self.log.info("Execution %s: %s -> %s", execution, decision.reason, decision.action.value)
        if decision.action is Action.RERUN:
            return RunStep.wait(self.start(run, rerun=used + 1, steps=now))
        self.running_execution = None
        if decision.action is Action.SUCCEED:
            job = execution.split("/executions/")[0]
            lost_work = self.progress.lost_work(run, len(tasks)) if self.progress is not None else []
            summary = run.summary(job, len(tasks), used, lost_work, chain_entries(history or []))
            summary["goodput"] = self.goodput(run)
            return RunStep.done(summary)
        error = CloudRunGpuExecutionError if decision.action is Action.FAIL else CloudRunGpuFatalError
        report = self.goodput(run, failed=True, publish=True)  # what the failed try cost, before raising
        raise error.for_decision(f"Execution {execution} {decision.outcome.value}", decision, finished, report)

    def _log_attempt(self, entry: AttemptEntry) -> None:
        if entry["outcome"] == OutcomeClass.UNOBSERVED.value:
            self.log.warning(
                "Attempt: %s task %s attempt %s: UNOBSERVED: it ended and Cloud Run retried it before a poll saw "
                "its result (the API keeps only the last attempt's); a shorter poll_interval (now %s s) sees more",
                entry["execution"], entry["task_index"], entry["attempt"], self.settings.poll_interval)
            return
        signal, took = entry["term_signal"], entry["duration_seconds"]
        how = f"signal {signal}" if signal else f"exit code {entry['exit_code']}"
        log = self.log.warning if OutcomeClass(entry["outcome"]) in RESUMABLE else self.log.info
        log("Attempt: %s task %s attempt %s: %s (%s%s) %s", entry["execution"], entry["task_index"], entry["attempt"],
            entry["outcome"], how, "" if took is None else f", {took:g} s", entry["message"])

    # --- checkpoint progress ---------------------------------------------------------------
    def history(self, run: RunState, own: list[run_v2.Execution]
                ) -> tuple[list[ExecutionProgress] | None, dict[int, int] | None]:
        """Every execution of the task instance, oldest first, with its checkpoint steps.

        Read from Cloud Run (the executions with this run key, each with the steps recorded at
        its start in :data:`~airflow_gpu_resilience.run_state.START_STEPS_ENV`) and the bucket (the
        steps now, the end of the newest), never from this try's memory. While the bucket cannot
        be read the read is retried for ``progress_read_timeout``; after that the newest
        execution's progress is unknown (see :mod:`~airflow_gpu_resilience.rerun_budget`).

        :param run: this try's state.
        :param own: the task instance's executions as :meth:`_find_own` lists them, newest first.
        :return: the history (``None`` without ``checkpoint_bucket``: the fixed budget applies) and
            the steps now (``None`` when unknown).
        """
        if self.progress is None:
            return None, None
        now = self._read_steps(run)
        return progress_history(list(reversed(own)), now, lambda e: self._class_of(run, e)), now

    def _read_steps(self, run: RunState) -> dict[int, int] | None:
        """The committed steps now, retried for ``progress_read_timeout``; ``None`` without a bucket
        or (logged) when unreadable."""
        if self.progress is None:
            return None
        now = self.progress.committed_steps(timeout=self.settings.progress_read_timeout)
        if now is None:
            self.log.warning("Checkpoint progress unreadable in gs://%s (transient errors retried for "
                             "progress_read_timeout=%g s): the newest execution's progress is unknown, neither progress "
                             "nor no progress (at most max_preemption_reruns=%s such executions after the last progress "
                             "are passed over)", self.progress.bucket, self.settings.progress_read_timeout, run.budget)
        return now

    def _class_of(self, run: RunState, execution: run_v2.Execution) -> OutcomeClass | None:
        """The class of a finished execution (cached in ``run.classes``), ``None`` while it runs."""
        if execution.name not in run.classes:
            state = execution_state(execution)
            if state is ExecutionState.RUNNING:
                return None
            tasks = self.hook.list_tasks(execution=execution.name)
            run.classes[execution.name] = _execution_class(
                [classify_task(t, self.settings.fatal_exit_codes) for t in tasks], state).value
        return OutcomeClass(run.classes[execution.name])

    # --- logs and the goodput account -------------------------------------------------------
    def copy_container_logs(self, execution: str, finished: bool = False) -> None:
        """With ``log_container_output``: log the execution's new Cloud Logging lines (all of them when
        ``finished``); a failed read is logged as a warning, never raised."""
        if not self.settings.log_container_output:
            return
        try:
            if self._log_follower is None or self._log_follower.execution != execution:
                hook = CloudRunLogsHook(gcp_conn_id=self.settings.gcp_conn_id,
                                        impersonation_chain=self.settings.impersonation_chain)
                created = self.hook.get_execution(execution=execution).create_time or None
                self._log_follower = ExecutionLogFollower(hook, execution, since=created)
            lines = self._log_follower.drain() if finished else self._log_follower.read()
        except Exception as exc:  # the task's outcome never depends on its logs
            self.log.warning("Cannot read the container logs of %s (roles/logging.viewer needed): %s", execution, exc)
            return
        for line in lines:
            self.log.info("Container log: %s", line.describe())

    def goodput(self, run: RunState, failed: bool = False, also: str | None = None,
                publish: bool = False) -> GoodputReport | None:
        """Build and log the goodput account of this try's executions (best effort: ``None`` on error).

        :param failed: the try is failing: the steps past each task's newest committed checkpoint
            are counted as wasted, not productive.
        :param also: an execution not in ``run.executions`` to include (the one being cancelled).
        :param publish: also hand the account to ``on_failure_goodput`` (on a failure: the
            summary, which carries it on success, is never returned then).
        """
        try:
            names = [e["name"] for e in run.executions] + ([also] if also and also not in
                                                            {e["name"] for e in run.executions} else [])
            executions = [(name, self.hook.list_tasks(execution=name)) for name in names]
            report = build_report(executions, self.progress.files if self.progress is not None else None,
                                  MAX_PROGRESS_TASKS, unfinished=failed)
        except Exception as exc:  # the account never changes the task's outcome or its error
            self.log.warning("Goodput account not built: %s", exc)
            return None
        self.log.info("Goodput account (seconds and share of each task's span):\n%s\n%s", report["table"],
                      report["headline"])
        if publish:
            try:
                self._on_failure_goodput(report)
            except Exception as exc:
                self.log.warning("Goodput account not pushed to XCom: %s", exc)
        return report


def _execution_class(outcomes: Sequence[TaskOutcome], state: ExecutionState) -> OutcomeClass:
    """A finished execution's class: the outcome :func:`decide` gives it (budget aside)."""
    return decide(outcomes, state=state, reruns_used=0, max_reruns=1).outcome


def reruns_used(own: Sequence[run_v2.Execution]) -> int:
    """:return: how many of a task instance's executions (all tries) are re-runs (``RERUN_ENV`` not 0)."""
    return sum(1 for e in own if execution_env(e).get(RERUN_ENV, "0") != "0")

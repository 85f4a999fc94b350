"""Exceptions raised by the provider, with the facts on attributes rather than only in strings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow.providers.common.compat.sdk import AirflowException, AirflowFailException

if TYPE_CHECKING:
    from typing import Self

    from google.cloud import run_v2

    from airflow_gpu_resilience.outcome import Decision


class _ExecutionErrorDetails:
    """What an execution failure carries, as attributes rather than parsed from the message.

    :param message: human-readable explanation.
    :param execution: full resource name of the execution, or ``None``.
    :param outcome: outcome class name (see :class:`~airflow_gpu_resilience.outcome.OutcomeClass`).
    :param exit_code: exit code of the blamed task's last attempt, or ``None``.
    :param log_uri: Cloud Logging URI of the execution or task, or ``None``.
    :param goodput: the try's goodput report (the summary's ``goodput``: per-task accounts, their
        total, the table and its one-line ``headline``), or ``None`` when it could not be built.
    """

    def __init__(
        self,
        message: str,
        *,
        execution: str | None = None,
        outcome: str | None = None,
        exit_code: int | None = None,
        log_uri: str | None = None,
        goodput: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.execution = execution
        self.outcome = outcome
        self.exit_code = exit_code
        self.log_uri = log_uri
        self.goodput = goodput

    @classmethod
    def for_decision(cls, head: str, decision: Decision, execution: run_v2.Execution,
                     goodput: dict | None = None) -> Self:
        """The error for a finished execution that ``decision`` fails, blaming its task.

        :param head: the message's start, e.g. ``"Execution NAME FAILED"``; ``": {reason}.
            Logs: {log URI}"`` is appended, with the goodput report's ``headline`` before
            ``Logs:`` when there is one.
        :param decision: the failing decision (:func:`~airflow_gpu_resilience.outcome.decide`).
        :param execution: the finished execution.
        :param goodput: the try's goodput report, or ``None`` (default).
        :return: the error, with the blamed task's exit code and its log URI (else the
            execution's).
        """
        blamed = decision.blamed
        log_uri = (blamed.log_uri if blamed else "") or execution.log_uri
        note = f" {goodput['headline']}" if goodput and goodput.get("headline") else ""
        return cls(
            f"{head}: {decision.reason}.{note} Logs: {log_uri}", execution=execution.name,
            outcome=decision.outcome.value, exit_code=blamed.exit_code if blamed else None, log_uri=log_uri,
            goodput=goodput,
        )


class CloudRunGpuExecutionError(_ExecutionErrorDetails, AirflowException):
    """A Cloud Run execution ended in a retryable failure (Airflow's ``retries`` apply).

    :param message: human-readable explanation.
    :param execution: full resource name of the failed execution, or ``None``.
    :param outcome: outcome class name (see :class:`~airflow_gpu_resilience.outcome.OutcomeClass`).
    :param exit_code: exit code of the blamed task's last attempt, or ``None``.
    :param log_uri: Cloud Logging URI of the execution or task, or ``None``.
    :param goodput: the try's goodput report, or ``None``.
    """


class CloudRunGpuFatalError(_ExecutionErrorDetails, AirflowFailException):
    """A Cloud Run execution ended in a failure that retrying cannot fix (no Airflow retry).

    Raised for FATAL exit codes, cancelled executions and an exhausted preemption budget.

    :param message: human-readable explanation.
    :param execution: full resource name of the execution, or ``None``.
    :param outcome: outcome class name, or ``None``.
    :param exit_code: exit code of the blamed task's last attempt, or ``None``.
    :param log_uri: Cloud Logging URI of the execution or task, or ``None``.
    :param goodput: the try's goodput report, or ``None``.
    """


class CloudRunGpuWaitTimeout(AirflowException):
    """Waiting for an execution to finish took longer than the configured timeout.

    :param message: human-readable explanation.
    :param execution: full resource name of the execution still running.
    """

    def __init__(self, message: str, *, execution: str | None = None) -> None:
        super().__init__(message)
        self.execution = execution


class CloudRunGpuTimeoutError(AirflowException):
    """The execute operator's overall ``timeout`` passed; the running execution was cancelled.

    Retryable: Airflow's ``retries`` apply, and the next try starts a new execution that resumes
    from the checkpoints.

    :param message: human-readable explanation.
    :param execution: full resource name of the cancelled execution.
    :param goodput: the try's goodput report (the cancelled execution's attempts included), or ``None``.
    """

    def __init__(self, message: str, *, execution: str | None = None, goodput: dict | None = None) -> None:
        super().__init__(message)
        self.execution = execution
        self.goodput = goodput


class CheckpointBucketNotOursError(AirflowFailException):
    """The checkpoint bucket exists and is not ours; nothing was granted, uploaded or deleted on it.

    Not retryable: another try finds the same bucket. The message says what to do: choose another
    ``bucket`` param, or adopt the bucket deliberately by adding the label
    ``managed-by=airflow-gpu-resilience`` to it.

    :param bucket: the bucket name.
    :param reason: why it is not ours (missing label, another project, unreadable).
    """

    def __init__(self, bucket: str, reason: str) -> None:
        super().__init__(
            f"Bucket {bucket!r} already exists and is not this deployment's: {reason}. Nothing was granted, uploaded "
            f"or deleted on it. Choose another `bucket` param, or, to use this bucket deliberately, label it: "
            f"gcloud storage buckets update gs://{bucket} --update-labels=managed-by=airflow-gpu-resilience"
        )
        self.bucket = bucket
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.bucket, self.reason)


class CloudRunJobNotOursError(AirflowFailException):
    """A Cloud Run job of the name exists and was not deployed by this provider; it was not changed.

    The deploy operator updates only a job that carries the label
    ``managed-by=airflow-gpu-resilience`` (it puts the label on every job it creates), so that a
    job name that collides with someone else's job never overwrites that job's image, command or
    service account. Not retryable: another try finds the same job. The message says what to do:
    choose another ``job_name``, or adopt the job deliberately (``adopt_existing_job=True`` on the
    deploy operator, or the label added by hand).

    :param job: the job's full resource name (``projects/P/locations/L/jobs/J``).
    :param labels: the job's labels as found.
    """

    def __init__(self, job: str, labels: dict[str, str]) -> None:
        name = job.rsplit("/", 1)[-1]
        super().__init__(
            f"Cloud Run job {job!r} already exists and was not deployed by airflow-gpu-resilience: it has no label "
            f"managed-by=airflow-gpu-resilience (its labels: {labels}). It was not changed. Choose another "
            f"`job_name`, or, to take the job over deliberately, pass adopt_existing_job=True to the deploy "
            f"operator or label it: gcloud run jobs update {name} --update-labels=managed-by=airflow-gpu-resilience"
        )
        self.job = job
        self.labels = labels

    def __reduce__(self):
        return type(self), (self.job, self.labels)

"""Exceptions raised by the provider, with the facts on attributes rather than only in strings."""

from __future__ import annotations

from airflow_gpu_resilience.compat import AirflowException, AirflowFailException


class _ExecutionErrorDetails:
    """What an execution failure carries, as attributes rather than parsed from the message.

    :param message: human-readable explanation.
    :param execution: full resource name of the execution, or ``None``.
    :param outcome: outcome class name (see :class:`~airflow_gpu_resilience.outcome.OutcomeClass`).
    :param exit_code: exit code of the blamed task's last attempt, or ``None``.
    :param log_uri: Cloud Logging URI of the execution or task, or ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        execution: str | None = None,
        outcome: str | None = None,
        exit_code: int | None = None,
        log_uri: str | None = None,
    ) -> None:
        super().__init__(message)
        self.execution = execution
        self.outcome = outcome
        self.exit_code = exit_code
        self.log_uri = log_uri


class CloudRunGpuExecutionError(_ExecutionErrorDetails, AirflowException):
    """A Cloud Run execution ended in a retryable failure (Airflow's ``retries`` apply).

    :param message: human-readable explanation.
    :param execution: full resource name of the failed execution, or ``None``.
    :param outcome: outcome class name (see :class:`~airflow_gpu_resilience.outcome.OutcomeClass`).
    :param exit_code: exit code of the blamed task's last attempt, or ``None``.
    :param log_uri: Cloud Logging URI of the execution or task, or ``None``.
    """


class CloudRunGpuFatalError(_ExecutionErrorDetails, AirflowFailException):
    """A Cloud Run execution ended in a failure that retrying cannot fix (no Airflow retry).

    Raised for FATAL exit codes, cancelled executions and an exhausted preemption budget.

    :param message: human-readable explanation.
    :param execution: full resource name of the execution, or ``None``.
    :param outcome: outcome class name, or ``None``.
    :param exit_code: exit code of the blamed task's last attempt, or ``None``.
    :param log_uri: Cloud Logging URI of the execution or task, or ``None``.
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
    """

    def __init__(self, message: str, *, execution: str | None = None) -> None:
        super().__init__(message)
        self.execution = execution

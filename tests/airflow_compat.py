"""Airflow names only the tests use, from where Airflow 2.11 and Airflow 3 keep them.

The provider's own names come from :mod:`airflow_gpu_resilience.compat`.
"""

from __future__ import annotations

from airflow_gpu_resilience.compat import AIRFLOW_V_3_0_PLUS

if AIRFLOW_V_3_0_PLUS:
    from airflow.sdk.exceptions import ParamValidationError

    try:
        from airflow.dag_processing.dagbag import DagBag
    except ImportError:  # Airflow 3.0
        from airflow.models.dagbag import DagBag
else:
    from airflow.exceptions import ParamValidationError
    from airflow.models.dagbag import DagBag

__all__ = ["DagBag", "ParamValidationError"]


def allow_execute_in_this_thread() -> None:
    """Let a test call an operator's ``execute`` directly from a thread it started.

    Airflow 2.11's ``ExecutorSafeguard`` keeps its callers in a thread-local that only the thread
    which imported ``airflow.models.baseoperator`` has; from any other thread ``execute`` fails
    with ``AttributeError: '_thread._local' object has no attribute 'callers'``. Airflow 3 needs
    nothing.
    """
    if not AIRFLOW_V_3_0_PLUS:
        from airflow.models.baseoperator import ExecutorSafeguard

        if not hasattr(ExecutorSafeguard._sentinel, "callers"):
            ExecutorSafeguard._sentinel.callers = {}

"""Extra links: the Cloud Run console page of an execution, and its logs in Logs Explorer.

The operator stores the finished URL in XCom (key ``xcom_key``) when it starts or attaches
to an execution; the UI reads it back. The URL builders are pure functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import quote

from airflow_gpu_resilience.compat import BaseOperatorLink, xcom_value

if TYPE_CHECKING:
    from airflow.providers.common.compat.sdk import BaseOperator, Context, TaskInstanceKey

CONSOLE = "https://console.cloud.google.com"


def _parts(execution: str) -> tuple[str, str, str, str]:
    """``(project, region, job, execution id)`` of a full execution name.

    :raises ValueError: if ``execution`` is not ``projects/*/locations/*/jobs/*/executions/*``.
    """
    parts = execution.split("/")
    if len(parts) != 8 or parts[0::2] != ["projects", "locations", "jobs", "executions"]:
        raise ValueError(f"{execution!r} is not a projects/*/locations/*/jobs/*/executions/* name")
    return parts[1], parts[3], parts[5], parts[7]


def execution_console_url(execution: str) -> str:
    """Cloud Run console page of an execution (its task list).

    :param execution: full execution name.
    :return: the URL.
    :raises ValueError: if the name is not a full execution name.
    """
    project, region, _, short = _parts(execution)
    return f"{CONSOLE}/run/jobs/executions/details/{region}/{short}/tasks?project={project}"


def logs_explorer_url(execution: str) -> str:
    """Logs Explorer query for every log line of an execution.

    :param execution: full execution name.
    :return: the URL.
    :raises ValueError: if the name is not a full execution name.
    """
    project, region, job, short = _parts(execution)
    query = (
        'resource.type="cloud_run_job"\n'
        f'resource.labels.job_name="{job}"\n'
        f'resource.labels.location="{region}"\n'
        f'labels."run.googleapis.com/execution_name"="{short}"'
    )
    return f"{CONSOLE}/logs/query;query={quote(query, safe='')}?project={project}"


class _PersistedLink(BaseOperatorLink):
    """A link whose URL the operator stored in XCom."""

    name: ClassVar[str]

    @classmethod
    def url_for(cls, execution: str, log_uri: str = "") -> str:
        """The URL of this link for ``execution`` (``log_uri``: the API's own log link, if any)."""
        raise NotImplementedError

    @classmethod
    def persist(cls, context: Context, execution: str, log_uri: str = "") -> None:
        """Store the URL for ``execution`` in the running task instance's XCom.

        :param context: the task's context.
        :param execution: full execution name.
        :param log_uri: the execution's ``log_uri`` from the API (may be empty).
        """
        cls.push(context["ti"], execution, log_uri)

    @classmethod
    def push(cls, ti: Any, execution: str, log_uri: str = "") -> None:
        """:meth:`persist` for a task instance: store the URL for ``execution`` in ``ti``'s XCom.

        :param ti: the running task instance.
        :param execution: full execution name.
        :param log_uri: the execution's ``log_uri`` from the API (may be empty).
        """
        ti.xcom_push(key=cls().xcom_key, value=cls.url_for(execution, log_uri))

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        """The stored URL, or ``""`` before the task started an execution."""
        value: Any = xcom_value(key=self.xcom_key, ti_key=ti_key)
        return value if isinstance(value, str) else ""


class CloudRunGpuExecutionLink(_PersistedLink):
    """Link to the Cloud Run console page of the execution the task started or attached to."""

    name = "Cloud Run execution"

    @classmethod
    def url_for(cls, execution: str, log_uri: str = "") -> str:
        """The console URL (``log_uri`` is ignored)."""
        return execution_console_url(execution)


class CloudRunGpuLogsLink(_PersistedLink):
    """Link to the execution's logs: the API's ``log_uri`` if set, else a Logs Explorer query."""

    name = "Cloud Run execution logs"

    @classmethod
    def url_for(cls, execution: str, log_uri: str = "") -> str:
        """``log_uri`` when the API gave one, else :func:`logs_explorer_url`."""
        return log_uri or logs_explorer_url(execution)

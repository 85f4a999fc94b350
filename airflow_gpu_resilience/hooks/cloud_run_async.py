"""Async Cloud Run calls for triggers and the shared execution watcher.

:class:`CloudRunGpuAsyncHook` reads executions and tasks page by page, so that a caller can stop
paging early and count every request. On gRPC (Google's endpoint by default, and the emulator under
``CLOUD_RUN_EMULATOR_HOST``) the calls are native ``grpc.aio`` calls of the ``run_v2``
``*AsyncClient`` classes: no thread per call. The REST transport has no async client, so over REST
each request runs the sync client in a worker thread (``asyncio.to_thread``).

Everything that blocks is done once per hook, off the event loop: the sync hook (whose
``GoogleBaseHook.__init__`` reads the Airflow connection) is built by ``sync_to_async`` and the
credentials are read in a thread. Importing this module is slow (the Google clients); importers
running on an event loop import it in a thread (see
:mod:`~airflow_gpu_resilience.triggers.cloud_run`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal

import grpc
from google.cloud import run_v2

from airflow.providers.google.common.consts import CLIENT_INFO
from airflow.providers.google.common.hooks.base_google import GoogleBaseAsyncHook

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.hooks.cloud_run_clients import emulator_host

__all__ = ["CloudRunGpuAsyncHook", "Page"]

#: One page of a list call: ``(items, next_page_token)``; the token is ``""`` on the last page.
Page = tuple[list, str]


class CloudRunGpuAsyncHook(GoogleBaseAsyncHook):
    """Async twin of :class:`~airflow_gpu_resilience.hooks.cloud_run.CloudRunGpuHook` for triggers.

    Where the calls go is the sync hook's choice (``CLOUD_RUN_EMULATOR_HOST``, the connection's
    ``api_endpoint``, Google's endpoint; see :mod:`~airflow_gpu_resilience.hooks.cloud_run_clients`).
    Reads take no retry of their own (``retry=None``): one method call is one request, and the
    caller decides when to try again (the watcher backs off with jitter).

    :param gcp_conn_id: Airflow connection id (default ``google_cloud_default``).
    :param impersonation_chain: service account (or chain) to impersonate, or ``None``.
    :param transport: ``"rest"``, ``"grpc"`` or ``None`` (see :class:`CloudRunGpuHook`).
    :param request_timeout: seconds per request (default 60).
    :param kwargs: further :class:`CloudRunGpuHook` arguments.
    """

    sync_hook_class = CloudRunGpuHook

    def __init__(
        self,
        gcp_conn_id: str = CloudRunGpuHook.default_conn_name,
        impersonation_chain: str | Sequence[str] | None = None,
        transport: Literal["rest", "grpc"] | None = None,
        request_timeout: float = 60.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(gcp_conn_id=gcp_conn_id, impersonation_chain=impersonation_chain, transport=transport,
                         request_timeout=request_timeout, **kwargs)
        self.request_timeout = request_timeout
        self._async_clients: dict[type, Any] | None = None
        self._channel: grpc.aio.Channel | None = None

    @property
    def native(self) -> bool:
        """Whether calls are native async (gRPC); ``False`` over REST (a thread per call). Known
        once a client was made."""
        return bool(self._async_clients)

    async def _clients(self) -> dict[type, Any] | None:
        """The async clients by sync kind (gRPC), or ``None`` over REST; made at the first call."""
        if self._async_clients is None:
            hook = await self.get_sync_hook()
            kwargs = await asyncio.to_thread(_async_client_kwargs, hook)  # reads credentials
            self._async_clients = {} if kwargs is None else self._make_clients(kwargs)
        return self._async_clients or None

    def _make_clients(self, kwargs: dict[str, Any]) -> dict[type, Any]:
        """Build the async clients on the event loop (a ``grpc.aio`` channel belongs to its loop)."""
        kinds = {run_v2.ExecutionsClient: run_v2.ExecutionsAsyncClient, run_v2.TasksClient: run_v2.TasksAsyncClient}
        host = kwargs.get("emulator_host")
        if host is None:
            return {sync: kind(**kwargs) for sync, kind in kinds.items()}
        self._channel = grpc.aio.insecure_channel(host)
        return {sync: kind(transport=kind.get_transport_class("grpc_asyncio")(channel=self._channel,
                                                                                client_info=CLIENT_INFO))
                for sync, kind in kinds.items()}

    async def _call(self, kind: type, location: str, method: str, request: Any) -> Any:
        """One request: native on gRPC, the sync client in a thread on REST."""
        clients = await self._clients()
        if clients is not None:
            return await getattr(clients[kind], method)(request=request, retry=None, timeout=self.request_timeout)
        hook = await self.get_sync_hook()

        def call() -> Any:  # in the thread: the first call also builds the client (credentials)
            client = hook.executions_client(location) if kind is run_v2.ExecutionsClient else hook.tasks_client(location)
            return getattr(client, method)(request=request, retry=None, timeout=self.request_timeout)

        return await asyncio.to_thread(call)

    async def list_executions_page(self, project_id: str, region: str, job_name: str = "-", page_token: str = "",
                                   page_size: int = 0) -> Page:
        """One ListExecutions request: a page of a job's executions, newest first.

        :param project_id: Google Cloud project.
        :param region: Cloud Run region.
        :param job_name: job id, or ``-`` (the default) for every job of the region.
        :param page_token: the previous page's token (default: the first page).
        :param page_size: executions per page, ``0`` for the server's default.
        :return: ``(executions, next_page_token)``.
        :raises google.api_core.exceptions.GoogleAPIError: the request's error (not retried).
        """
        request = run_v2.ListExecutionsRequest(parent=CloudRunGpuHook.job_path(project_id, region, job_name),
                                               page_token=page_token, page_size=page_size)
        pager = await self._call(run_v2.ExecutionsClient, region, "list_executions", request)
        return list(pager.executions), pager.next_page_token

    async def list_tasks_page(self, parent: str, page_token: str = "", page_size: int = 0) -> Page:
        """One ListTasks request: a page of the tasks of ``parent``.

        :param parent: a full execution name; ``executions/-`` and ``jobs/-`` are wildcards
            (``projects/P/locations/R/jobs/-/executions/-``: every task of the region).
        :param page_token: the previous page's token (default: the first page).
        :param page_size: tasks per page, ``0`` for the server's default.
        :return: ``(tasks, next_page_token)``.
        :raises google.api_core.exceptions.GoogleAPIError: the request's error (not retried).
        """
        request = run_v2.ListTasksRequest(parent=parent, page_token=page_token, page_size=page_size)
        pager = await self._call(run_v2.TasksClient, parent.split("/")[3], "list_tasks", request)
        return list(pager.tasks), pager.next_page_token

    async def get_execution(self, execution: str) -> run_v2.Execution:
        """One GetExecution request for a full execution name (not retried).

        :raises google.api_core.exceptions.NotFound: if there is no such execution.
        """
        request = run_v2.GetExecutionRequest(name=execution)
        return await self._call(run_v2.ExecutionsClient, execution.split("/")[3], "get_execution", request)

    async def list_tasks(self, execution: str) -> list[run_v2.Task]:
        """Every task of an execution (all pages), sorted by index (not retried)."""
        tasks, token = await self.list_tasks_page(execution)
        while token:
            more, token = await self.list_tasks_page(execution, token)
            tasks.extend(more)
        return sorted(tasks, key=lambda task: task.index)

    async def cancel_execution(self, execution: str) -> run_v2.Execution:
        """:meth:`CloudRunGpuHook.cancel_execution` (retried on transient errors) in a thread: rare,
        and it keeps the sync hook's handling of an execution that already finished."""
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.cancel_execution, execution=execution)

    async def close(self) -> None:
        """Close the emulator's ``grpc.aio`` channel, if one was opened (the clients' own channels
        close with them)."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def _async_client_kwargs(hook: CloudRunGpuHook) -> dict[str, Any] | None:
    """What the async clients need, read off the event loop (credentials may do I/O).

    :return: ``None`` over REST (no async client), ``{"emulator_host": host}`` under
        ``CLOUD_RUN_EMULATOR_HOST``, else the clients' ``credentials``, ``client_info`` and
        ``client_options``.
    """
    host = emulator_host()
    if host:
        return {"emulator_host": host}
    if hook.transport == "rest":
        return None
    return {"credentials": hook.get_credentials(), "client_info": CLIENT_INFO,
            "client_options": hook.get_client_options(hook.api_endpoint)}

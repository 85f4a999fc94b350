"""Async trigger that waits for a Cloud Run execution to finish.

Importing this module is light (the standard library and Airflow's trigger base class): the
triggerer imports it on its event loop. The Google clients, the hook and the shared watcher
(:mod:`.execution_watcher`) are imported in a thread the first time a trigger runs, with the
garbage collector paused (:func:`_import_unscanned`): the import's allocations would otherwise
start a full collection of the triggerer's heap in that thread, which holds the interpreter
lock, and so the event loop, for as long as it scans.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import importlib
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from types import ModuleType
from typing import Any, Literal

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_gpu_resilience.compat import AIRFLOW_V_3_0_PLUS

#: Most attempt records one event carries (keeps events small; the oldest are kept).
MAX_ATTEMPT_RECORDS = 200
#: Seconds that a task deferring to this trigger adds to the trigger's ``timeout`` for Airflow's
#: own defer timeout: the trigger's timeout event comes first, Airflow's covers a lost triggerer.
DEFER_TIMEOUT_MARGIN = 60.0


class ExecutionEventStatus(str, enum.Enum):
    """``status`` of a :class:`CloudRunGpuExecutionTrigger` event."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    ERROR = "error"


#: The modules a trigger needs once it runs, imported in a thread (:func:`_import`).
_WATCHER_MODULE = "airflow_gpu_resilience.triggers.execution_watcher"
_OUTCOME_MODULE = "airflow_gpu_resilience.outcome"
_ASYNC_HOOK_MODULE = "airflow_gpu_resilience.hooks.cloud_run_async"


_IMPORTED: dict[str, ModuleType] = {}
_IMPORT_LOCK = threading.Lock()
#: The imports in flight, per event loop: module name -> the one thread's future.
_IMPORTING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def _import(name: str) -> ModuleType:
    """:func:`_import_unscanned` in a thread until it returned once, so that the Google clients'
    import never blocks the triggerer's event loop.

    Triggers that start together wait for one thread per module (its future, shielded): none
    sees the module half-imported, and a thousand triggers starting in one turn of the loop add a
    thousand waiters to one future instead of queueing a thousand jobs to the executor in that
    turn. A cancelled trigger leaves the import to the others; a failed import fails its waiters,
    and the next trigger tries again.
    """
    module = _IMPORTED.get(name)
    if module is not None:
        return module
    in_flight = _IMPORTING.setdefault(asyncio.get_running_loop(), {})
    importing = in_flight.get(name)
    if importing is None:
        importing = in_flight[name] = asyncio.ensure_future(asyncio.to_thread(_import_unscanned, name))
        importing.add_done_callback(lambda _: in_flight.pop(name, None))
    module = _IMPORTED[name] = await asyncio.shield(importing)
    return module


def _import_unscanned(name: str) -> ModuleType:
    """``importlib.import_module(name)``; when ``name`` is not imported yet, with Python's cyclic
    garbage collector paused during the import and every object then alive frozen
    (:func:`gc.freeze`) before it resumes (its state before is kept: a collector the process had
    disabled stays disabled).

    Why: the Google clients' import allocates many objects that live as long as the process.
    Without the pause they start a collection of the oldest generation (CPython's ``gcmodule.c``
    collects it once the objects that survived younger collections exceed a quarter of those it
    holds), which scans every object of the process, the whole triggerer's, in this thread and
    with the interpreter lock held: the event loop stands still as long, and Airflow's triggerer
    warns that it was blocked. Frozen objects are never scanned again and are still freed when
    their last reference goes; only reference cycles among them are never collected, a bounded
    cost paid once per process (Airflow's DAG processor manager freezes its heap likewise, for
    good, before its parsing loop).

    :param name: a module's dotted name.
    :return: the module.
    :raises ImportError: as :func:`importlib.import_module` (the collector resumes all the same).
    """
    with _IMPORT_LOCK:
        if name in sys.modules:
            return importlib.import_module(name)
        enabled = gc.isenabled()
        gc.disable()
        try:
            return importlib.import_module(name)
        finally:
            gc.freeze()
            if enabled:
                gc.enable()


class CloudRunGpuExecutionTrigger(BaseTrigger):
    """Wait for a Cloud Run execution to finish; yield one small JSON event.

    The trigger does not poll on its own: it subscribes to the shared watcher of its
    execution's connection and region (:mod:`~airflow_gpu_resilience.triggers.execution_watcher`),
    which lists the region's executions once per poll interval for every trigger of the
    process and reads tasks only where an attempt ended.

    The event is ``{"status", "execution", "message", "attempts", "carry"}``:

    - ``status``: an :class:`ExecutionEventStatus` value (``succeeded``, ``failed``,
      ``cancelled``, ``timeout`` when ``timeout`` passed first, ``error`` for a non-transient
      API error);
    - ``execution``: the full execution name;
    - ``message``: the execution's ``Completed`` condition message or the error;
    - ``attempts``: finished task attempts seen while watching
      (:meth:`~airflow_gpu_resilience.outcome.AttemptRecord.to_dict`), at most 200;
    - ``carry``: the ``carry`` argument, unchanged (state the operator needs back).

    The classification of the tasks is left to the operator, which re-reads them with a fresh
    hook; transient API errors (503, 429, deadline, a broken connection) delay the watcher's
    next poll, with jittered backoff, and never end the wait.

    :param execution: full execution name.
    :param gcp_conn_id: Airflow connection id (default ``google_cloud_default``).
    :param impersonation_chain: service account (or chain) to impersonate, or ``None``.
    :param transport: ``"rest"``, ``"grpc"`` or ``None`` (chosen from the endpoint; always gRPC under
        ``CLOUD_RUN_EMULATOR_HOST``, see :mod:`~airflow_gpu_resilience.hooks.cloud_run_clients`).
    :param poll_interval: seconds between polls (default 10); the watcher polls at the smallest
        interval its triggers ask for, at least
        :data:`~airflow_gpu_resilience.triggers.watch_rules.MIN_POLL_INTERVAL`.
    :param timeout: seconds to wait in total before a ``timeout`` event; ``None`` waits forever.
    :param carry: JSON-able dict echoed back in the event (default ``None``).
    :param cancel_on_kill: cancel the execution when a user kills the deferred task (marks it
        failed or success, or clears it; default ``True``). Not on triggerer restarts, shutdowns
        or timeouts. Airflow 3.3+ calls :meth:`on_kill` for such a user action, but only when the
        cancellation's message survives every ``await`` under ``run`` (one inside the Google
        client or a thread hand-off can drop it), and older Airflow never calls it; so ``run``
        also catches the cancellation and, when the task instance is no longer deferred (its
        state read back as the Google provider's triggers do: from the triggerer's supervisor on
        Airflow 3, from the database on Airflow 2), cancels the execution itself. The execution
        is cancelled once either way.
    """

    def __init__(
        self,
        execution: str,
        gcp_conn_id: str = "google_cloud_default",
        impersonation_chain: str | Sequence[str] | None = None,
        transport: Literal["rest", "grpc"] | None = None,
        poll_interval: float = 10.0,
        timeout: float | None = None,
        carry: dict[str, Any] | None = None,
        cancel_on_kill: bool = True,
    ) -> None:
        super().__init__()
        self.execution = execution
        self.gcp_conn_id = gcp_conn_id
        self.impersonation_chain = impersonation_chain
        self.transport = transport
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.carry = carry
        self.cancel_on_kill = cancel_on_kill
        self._cancel_sent = False
        self._cancelling: asyncio.Future | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """The trigger's dotted class path and exactly its constructor arguments."""
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "execution": self.execution,
                "gcp_conn_id": self.gcp_conn_id,
                "impersonation_chain": self.impersonation_chain,
                "transport": self.transport,
                "poll_interval": self.poll_interval,
                "timeout": self.timeout,
                "carry": self.carry,
                "cancel_on_kill": self.cancel_on_kill,
            },
        )

    @property
    def defer_timeout(self) -> timedelta | None:
        """The ``timeout`` to defer to this trigger with: ``timeout`` plus :data:`DEFER_TIMEOUT_MARGIN`."""
        return None if self.timeout is None else timedelta(seconds=self.timeout + DEFER_TIMEOUT_MARGIN)

    def _event(self, status: ExecutionEventStatus, message: str, watched: Any) -> TriggerEvent:
        return TriggerEvent(
            {
                "status": status.value,
                "execution": self.execution,
                "message": message,
                "attempts": watched.watch.attempts.to_dicts(MAX_ATTEMPT_RECORDS),
                "carry": self.carry,
            }
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Wait, through the region's shared watcher, until the execution finishes or ``timeout`` passes."""
        try:
            event = await self._wait()
        except asyncio.CancelledError:
            if self.cancel_on_kill and not self._cancel_sent:
                # Shielded: the triggerer repeats the cancellation while the trigger runs, which
                # must not stop the state check or the cancel request half-way.
                self._cancelling = asyncio.ensure_future(self._cancel_if_killed_by_user())
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(self._cancelling)
            raise
        yield event

    async def _cancel_if_killed_by_user(self) -> None:
        if await self._killed_by_user():
            await self._cancel("the task instance is no longer deferred")

    async def _wait(self) -> TriggerEvent:
        """Subscribe to the execution's watcher; the event once its watch ends or ``timeout`` passes.
        The subscription ends with this call (also when it is cancelled)."""
        started = time.monotonic()
        watcher = await _import(_WATCHER_MODULE)  # the outcome module comes with it; read for the event only
        async with watcher.watch_execution(
            self.execution, gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain,
            transport=self.transport, poll_interval=self.poll_interval,
        ) as watched:
            left = None if self.timeout is None else max(0.0, self.timeout - (time.monotonic() - started))
            try:
                result = await asyncio.wait_for(asyncio.shield(watched.done), left)
            except asyncio.TimeoutError:
                return self._event(ExecutionEventStatus.TIMEOUT, f"still running after {self.timeout} s", watched)
        if result.error is not None:
            return self._event(ExecutionEventStatus.ERROR, result.error, watched)
        outcome = await _import(_OUTCOME_MODULE)
        status = ExecutionEventStatus[outcome.execution_state(result.execution).name]
        return self._event(status, outcome.completion_message(result.execution), watched)

    async def on_kill(self) -> None:
        """Cancel the execution when a user kills the deferred task (if ``cancel_on_kill``)."""
        if self._cancelling is not None:  # run() saw the cancellation first: let it finish
            with contextlib.suppress(Exception):
                await asyncio.shield(self._cancelling)
        if self.cancel_on_kill and not self._cancel_sent:
            await self._cancel("task killed by a user")

    async def _cancel(self, why: str) -> None:
        self._cancel_sent = True
        self.log.info("Cancelling execution %s: %s", self.execution, why)
        hooks = await _import(_ASYNC_HOOK_MODULE)
        from google.api_core import exceptions as gexc  # imported with the hook's module

        hook = hooks.CloudRunGpuAsyncHook(gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain,
                                          transport=self.transport)
        try:
            await hook.cancel_execution(self.execution)
        except gexc.NotFound:
            self.log.info("Execution %s no longer exists", self.execution)
        except gexc.FailedPrecondition as exc:  # already finished or cancelled
            self.log.info("Execution %s not cancelled: %s", self.execution, exc)

    async def _killed_by_user(self) -> bool:
        """Whether the task instance has left ``deferred`` for a state only a user (or the task's
        end) gives it: not ``scheduled`` (an Airflow defer timeout), ``queued`` or ``running``;
        ``False`` when the state cannot be read (a triggerer going down must never cancel)."""
        ti = getattr(self, "task_instance", None)
        if ti is None:
            return False
        try:
            state = await _task_instance_state(ti)
        except Exception as exc:  # the triggerer may be shutting down: keep the execution
            self.log.warning("Could not read the state of %s (%s): execution %s left running", ti, exc,
                             self.execution)
            return False
        self.log.info("Trigger cancelled; task instance state: %s", state)
        return state not in ("deferred", "scheduled", "queued", "running", "up_for_reschedule")


async def _task_instance_state(ti) -> str | None:
    """The current state of ``ti`` (the trigger's task instance), as a string or ``None``."""
    if AIRFLOW_V_3_0_PLUS:
        from asgiref.sync import sync_to_async
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        states = await sync_to_async(RuntimeTaskInstance.get_task_states)(
            dag_id=ti.dag_id, task_ids=[ti.task_id], run_ids=[ti.run_id], map_index=ti.map_index)
        state = states.get(ti.run_id, {}).get(ti.task_id)
    else:
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session

        def read():
            with create_session() as session:
                return session.query(TaskInstance.state).filter_by(
                    dag_id=ti.dag_id, task_id=ti.task_id, run_id=ti.run_id, map_index=ti.map_index).scalar()

        state = await asyncio.to_thread(read)
    return None if state is None else str(getattr(state, "value", state))

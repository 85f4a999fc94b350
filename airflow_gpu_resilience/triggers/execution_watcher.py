"""One execution watcher per (connection, project, region) in a process, shared by every trigger.

The triggerer runs all its triggers in one event loop. Instead of one GetExecution and one
ListTasks per trigger and poll, :func:`watch_execution` subscribes a trigger to the
:class:`ExecutionWatcher` of its execution's region, one ``asyncio`` task that per poll interval:

1. lists the region's executions, ``ListExecutions`` of ``projects/P/locations/R/jobs/-``, page by
   page, newest first, until every watched execution was seen (an execution missing from a
   complete listing is read with one GetExecution: gone, it ends its watch with ``NotFound``);
2. reads the tasks only of executions whose counts say an attempt ended
   (:func:`~.watch_rules.needs_tasks`), with one ListTasks per execution or one of the whole region
   (``jobs/-/executions/-``), whichever takes fewer requests;
3. records their finished attempts and resolves the watch of each finished execution.

Triggers of one execution (duplicates) share one :class:`Watched` and its attempt record. The
poll interval is the smallest its triggers ask for, at least
:data:`~.watch_rules.MIN_POLL_INTERVAL`. A 429, 503 or timeout delays the next poll with
jittered exponential backoff (:func:`~.watch_rules.backoff_delay`) and never ends a watch; any
other API error of the listing ends every watch of the region with that error (an ``error``
event), as one of a single execution's reads ends its watch. The watcher stops, and gives up its
clients, when its last trigger leaves; several triggerers (high availability) each run their own.
The registry is per event loop.

Import this module off the event loop (it imports the Google clients); the trigger does.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import random
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from google.api_core import exceptions as gexc
from google.cloud import run_v2

from airflow_gpu_resilience.execution_watch import ExecutionWatch, PollState
from airflow_gpu_resilience.hooks.cloud_run_retry import TRANSIENT_ERRORS
from airflow_gpu_resilience.hooks.cloud_run_async import CloudRunGpuAsyncHook
from airflow_gpu_resilience.hooks.cloud_run_clients import emulator_host
from airflow_gpu_resilience.outcome import ExecutionState, execution_state
from airflow_gpu_resilience.triggers.watch_rules import (
    Counts,
    backoff_delay,
    counts_of,
    needs_tasks,
    region_wide_is_fewer,
    task_execution,
    watch_interval,
)

__all__ = ["ExecutionWatcher", "WatchResult", "Watched", "WatcherKey", "watch_execution", "watchers"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Items per page asked of ListExecutions and ListTasks (the server may send fewer).
PAGE_SIZE = 1000
#: Per-execution ListTasks requests in flight at once.
TASK_READS_AT_ONCE = 8
#: Longest stretch (seconds) a poll works on listed items before it hands the event loop back, so
#: that other triggers run in between: the items' cost varies (an execution whose attempts are
#: recorded takes far longer than one that is only counted), a time slice does not.
TURN_SECONDS = 0.005
#: Errors after which the next poll is delayed (never the end of a watch).
RETRYABLE = (*TRANSIENT_ERRORS, gexc.RetryError)


@dataclass(frozen=True)
class WatcherKey:
    """What one watcher serves: a connection (id, impersonation, transport, emulator) and a region."""

    gcp_conn_id: str
    impersonation_chain: str | tuple[str, ...] | None
    transport: str | None
    emulator: str | None
    project: str
    region: str

    @classmethod
    def of(cls, execution: str, gcp_conn_id: str, impersonation_chain: str | Sequence[str] | None,
           transport: str | None) -> WatcherKey:
        """The key of ``execution``'s watcher (no I/O).

        :raises ValueError: naming ``execution`` when it is not a full execution name.
        """
        parts = execution.split("/")
        if len(parts) != 8 or parts[0::2] != ["projects", "locations", "jobs", "executions"]:
            raise ValueError(f"execution={execution!r}: give the full name "
                             "projects/P/locations/R/jobs/J/executions/E")
        chain = impersonation_chain if impersonation_chain is None or isinstance(impersonation_chain, str) \
            else tuple(impersonation_chain)
        return cls(gcp_conn_id, chain, transport, emulator_host(), parts[1], parts[3])


@dataclass(frozen=True)
class WatchResult:
    """How a watch ended: the finished execution, or a non-transient API error's text."""

    execution: run_v2.Execution | None = None
    error: str | None = None


@dataclass(eq=False)
class Watched:
    """One watched execution, shared by all its subscribers.

    :param name: full execution name.
    :param watch: its finished attempts and the finished rule
        (:class:`~airflow_gpu_resilience.execution_watch.ExecutionWatch`, no timeout).
    :param done: resolved with the :class:`WatchResult` (never with an exception).
    """

    name: str
    watch: ExecutionWatch
    done: asyncio.Future
    subscribers: int = 0
    counts: Counts | None = None
    listed_at: float | None = None

    def end(self, result: WatchResult) -> None:
        """Resolve :attr:`done` once."""
        if not self.done.done():
            self.done.set_result(result)


def error_text(exc: BaseException) -> str:
    """An API error as events carry it: ``"NotFound: 404 ..."``."""
    return f"{type(exc).__name__}: {exc}"


@dataclass(eq=False)
class ExecutionWatcher:
    """Watches the executions of one region for every subscribed trigger (see the module docs).

    :param key: the connection and region.
    :param hook: the async hook its reads go through.
    :param rng: the backoff's random source.

    :attr:`polls` counts the polls that listed the region (each one paged ListExecutions).
    """

    key: WatcherKey
    hook: CloudRunGpuAsyncHook
    rng: random.Random = field(default_factory=random.Random)
    watched: dict[str, Watched] = field(default_factory=dict)
    intervals: Counter = field(default_factory=Counter)
    polls: int = 0
    task: asyncio.Task | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _region_wide_ok: bool = True

    @property
    def interval(self) -> float:
        """The poll interval now (:func:`~.watch_rules.watch_interval` of the subscribers')."""
        return watch_interval(+self.intervals)

    def subscribe(self, execution: str, poll_interval: float) -> Watched:
        """Watch ``execution`` (shared with its other subscribers); starts the watcher's task."""
        entry = self.watched.get(execution)
        if entry is None:
            loop = asyncio.get_running_loop()
            entry = Watched(execution, ExecutionWatch(poll_interval, None, time.monotonic()), loop.create_future())
            self.watched[execution] = entry
        entry.subscribers += 1
        self.intervals[poll_interval] += 1
        if self.task is None:  # in a context of its own: not the first trigger's (its log routing, say)
            self.task = contextvars.Context().run(asyncio.get_running_loop().create_task, self._run(),
                                                  name=f"cloud-run-watcher {self.key}")
        return entry

    def unsubscribe(self, entry: Watched, poll_interval: float) -> None:
        """Leave a watch; the execution is forgotten with its last subscriber, the watcher stops
        with its last execution."""
        entry.subscribers -= 1
        self.intervals[poll_interval] -= 1
        if entry.subscribers <= 0 and self.watched.get(entry.name) is entry:
            del self.watched[entry.name]
        if not self.watched:
            self._wake.set()

    async def _run(self) -> None:
        failures = 0
        try:
            while self.watched:
                delay = self.interval
                try:
                    await self.poll()
                    failures = 0
                except RETRYABLE as exc:
                    failures += 1
                    delay = backoff_delay(failures, self.interval, self.rng)
                    log.warning("Cloud Run reads of %s/%s failed (%s); next poll in %.1f s", self.key.project,
                                self.key.region, error_text(exc), delay)
                except Exception as exc:  # the listing's API error (or a bug) ends every watch, as an event
                    log.exception("Watching the executions of %s/%s failed", self.key.project, self.key.region)
                    for entry in list(self.watched.values()):
                        entry.end(WatchResult(error=error_text(exc)))
                self._wake.clear()
                if self.watched:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), delay)
        finally:
            _retire(self)
            with contextlib.suppress(Exception):
                await self.hook.close()

    async def poll(self) -> None:
        """One poll: list the region, read the tasks that changed, resolve finished watches.

        :raises google.api_core.exceptions.GoogleAPIError: a listing's error (:data:`RETRYABLE`
            ones delay the next poll; the watches stay).
        """
        pending = {name: e for name, e in self.watched.items() if not e.done.done()}
        if not pending:
            return
        self.polls += 1
        found, region_tasks = await self._list(set(pending))
        for name in set(pending) - set(found):  # not in a complete listing: ask for it alone
            try:
                found[name] = await self.hook.get_execution(name)
            except RETRYABLE:
                raise
            except gexc.GoogleAPIError as exc:
                pending[name].end(WatchResult(error=error_text(exc)))
        now = time.monotonic()
        wanted: dict[str, tuple[run_v2.Execution, Counts]] = {}
        async for name, execution in _in_turns(found.items()):
            entry = pending[name]
            counts = counts_of(execution, execution_state(execution) is not ExecutionState.RUNNING)
            if needs_tasks(entry.counts, counts, None if entry.listed_at is None else now - entry.listed_at):
                wanted[name] = (execution, counts)
            else:
                entry.counts = counts
                if counts.finished:
                    self._apply(entry, execution, [])
        tasks = await self._read_tasks({name: int(e.task_count) for name, (e, _) in wanted.items()}, region_tasks)
        async for name, task_list in _in_turns(tasks.items()):
            execution, counts = wanted[name]
            entry = pending[name]
            if isinstance(task_list, BaseException):
                entry.end(WatchResult(error=error_text(task_list)))
                continue
            entry.counts, entry.listed_at = counts, now
            self._apply(entry, execution, task_list)

    @staticmethod
    def _apply(entry: Watched, execution: run_v2.Execution, tasks: list[run_v2.Task]) -> None:
        if entry.watch.step(execution, tasks, time.monotonic()).state is PollState.FINISHED:
            entry.end(WatchResult(execution=execution))

    async def _list(self, names: set[str]) -> tuple[dict[str, run_v2.Execution], int | None]:
        """Page through the region's executions until all of ``names`` were seen.

        :return: the ones seen, and every task of the region (``None`` unless the listing was complete).
        """
        found: dict[str, run_v2.Execution] = {}
        token, region_tasks = "", 0
        while True:
            executions, token = await self.hook.list_executions_page(
                self.key.project, self.key.region, page_token=token, page_size=PAGE_SIZE)
            async for execution in _in_turns(executions):
                region_tasks += execution.task_count
                if execution.name in names:
                    found[execution.name] = execution
            if not token:
                return found, region_tasks
            if len(found) == len(names):
                return found, None

    async def _read_tasks(self, task_counts: dict[str, int], region_tasks: int | None) -> dict[str, list | BaseException]:
        """The tasks of each execution of ``task_counts`` (or its non-transient error).

        :raises google.api_core.exceptions.GoogleAPIError: a :data:`RETRYABLE` error.
        """
        if not task_counts:
            return {}
        if self._region_wide_ok and region_wide_is_fewer(task_counts, region_tasks, PAGE_SIZE):
            parent = f"projects/{self.key.project}/locations/{self.key.region}/jobs/-/executions/-"
            try:
                return await self._region_tasks(parent, task_counts)
            except RETRYABLE:
                raise
            except gexc.GoogleAPIError as exc:  # a server that refuses the wildcard: one per execution
                log.warning("ListTasks of %s refused (%s); reading tasks per execution", parent, error_text(exc))
                self._region_wide_ok = False
        slots = asyncio.Semaphore(TASK_READS_AT_ONCE)

        async def one(name: str) -> list | BaseException:
            async with slots:
                try:
                    return await self.hook.list_tasks(name)
                except RETRYABLE:
                    raise
                except gexc.GoogleAPIError as exc:
                    return exc

        names = list(task_counts)
        return dict(zip(names, await asyncio.gather(*(one(name) for name in names))))

    async def _region_tasks(self, parent: str, wanted: Iterable[str]) -> dict[str, list]:
        """Every page of the region-wide ListTasks ``parent``, grouped by execution as it arrives.

        :return: each of ``wanted`` -> its tasks in the listing's order (an empty list for one
            with none listed).
        """
        groups: dict[str, list] = {name: [] for name in wanted}
        token = ""
        while True:
            listed, token = await self.hook.list_tasks_page(parent, token, PAGE_SIZE)
            async for task in _in_turns(listed):
                group = groups.get(task_execution(task.name))
                if group is not None:
                    group.append(task)
            if not token:
                return groups


async def _in_turns(items: Iterable[_T], turn: float = TURN_SECONDS,
                    clock: Callable[[], float] = time.perf_counter) -> AsyncIterator[_T]:
    """``items``, handing the event loop back (``asyncio.sleep(0)``: one turn of the loop, other
    triggers run) whenever ``turn`` seconds have passed since it last did, the caller's work on
    the items included; at least one item per turn.

    :param items: what to iterate.
    :param turn: seconds per turn (default :data:`TURN_SECONDS`).
    :param clock: the clock (default ``time.perf_counter``).
    """
    ends = clock() + turn
    for item in items:
        yield item
        if clock() >= ends:
            await asyncio.sleep(0)
            ends = clock() + turn


#: The watchers of each event loop, by key.
_REGISTRY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def watchers() -> dict[WatcherKey, ExecutionWatcher]:
    """The running event loop's watchers, by key (the registry itself: do not change it)."""
    return _REGISTRY.setdefault(asyncio.get_running_loop(), {})


def _retire(watcher: ExecutionWatcher) -> None:
    registry = _REGISTRY.get(asyncio.get_running_loop(), {})
    if registry.get(watcher.key) is watcher:
        del registry[watcher.key]


@contextlib.asynccontextmanager
async def watch_execution(execution: str, *, gcp_conn_id: str, impersonation_chain: str | Sequence[str] | None,
                          transport: str | None, poll_interval: float) -> AsyncIterator[Watched]:
    """Subscribe to ``execution`` at its region's watcher for the ``async with`` block.

    :param execution: full execution name.
    :param gcp_conn_id: Airflow connection id.
    :param impersonation_chain: service account (or chain) to impersonate, or ``None``.
    :param transport: ``"rest"``, ``"grpc"`` or ``None`` (see the hook).
    :param poll_interval: seconds between polls this subscriber asks for (> 0).
    :return: the shared :class:`Watched`; await its ``done`` (shielded: it is shared).
    :raises ValueError: ``execution`` is not a full execution name.
    """
    key = WatcherKey.of(execution, gcp_conn_id, impersonation_chain, transport)
    registry = watchers()
    watcher = registry.get(key)
    if watcher is None:
        hook = CloudRunGpuAsyncHook(gcp_conn_id=gcp_conn_id, impersonation_chain=impersonation_chain,
                                    transport=transport)
        watcher = registry[key] = ExecutionWatcher(key, hook)
    entry = watcher.subscribe(execution, poll_interval)
    try:
        yield entry
    finally:
        watcher.unsubscribe(entry, poll_interval)

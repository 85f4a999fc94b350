"""Read the bundled worker's progress and attempt files from the checkpoint bucket, best effort.

The worker writes, per task, under ``{prefix}/task-{index}/`` in the checkpoint bucket
(``prefix`` is the job name, plus a run id when the DAG adds one):

- ``progress.json``: ``{step, total_steps, status, updated_at, loss, steps_per_second}``;
- ``metrics.json`` (when finished): final metrics with ``attempts`` / ``history``, each entry
  ``{execution, attempt, task_index, resumed_from_step, lost_steps}``;
- ``attempts.json``: ``{"attempts": [...]}``, the same entries, also for unfinished runs;
- checkpoints and their commit records, written after the data: ``ckpt-{step:08d}.pt`` +
  ``ckpt-{step:08d}.commit.json`` (the bundled worker, ``ResilientLoop``), or a framework's
  ``<prefix><step><suffix>`` (a folder or a file) + ``<prefix><step><suffix>.commit.json``. The
  record schema, with its ``format`` version, is the one ``docs/worker-contract.rst`` documents ("The task
  folder's contract"); :mod:`~airflow_gpu_resilience.commit_records` reads it without importing the
  worker, :meth:`CheckpointFilesHook.task_checkpoints` lists the folders for it;
- ``goodput-{execution}-{attempt}.json``: one attempt's goodput events (see
  :mod:`airflow_gpu_resilience.goodput`).

Reads go through the Google provider's ``GCSHook`` (which follows ``STORAGE_EMULATOR_HOST``) and
never raise: a missing, torn or unreadable file is ``None`` (or an empty list), because progress
reporting must never fail a task.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from google.api_core.exceptions import NotFound
from google.api_core.retry import Retry
from google.cloud.storage.retry import DEFAULT_RETRY

from airflow_gpu_resilience.commit_records import TaskCheckpoints, non_negative_int, task_checkpoints

PROGRESS_FILE = "progress.json"
METRICS_FILE = "metrics.json"
ATTEMPTS_FILE = "attempts.json"
GOODPUT_PREFIX = "goodput-"
#: Most goodput events files read per task (the newest names, by execution and attempt).
MAX_GOODPUT_FILES = 200

log = logging.getLogger(__name__)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class TaskProgress:
    """One task's ``progress.json``.

    :param task_index: task index (0-based).
    :param step: optimizer steps done.
    :param total_steps: steps of the whole run.
    :param status: the worker's status (``running``, ``preempted``, ``completed``).
    :param updated_at: when the worker wrote the file (ISO 8601 UTC), or ``""``.
    :param loss: the running loss, or ``None``.
    :param steps_per_second: the current attempt's rate (steps per second); 0 when unknown.
    """

    task_index: int
    step: int
    total_steps: int
    status: str = ""
    updated_at: str = ""
    loss: float | None = None
    steps_per_second: float = 0.0

    @classmethod
    def from_json(cls, task_index: int, data: Any, source: str = PROGRESS_FILE) -> TaskProgress | None:
        """Parse a ``progress.json`` object; ``None`` unless ``step`` and ``total_steps`` are integers >= 0.

        A ``step`` beyond ``total_steps`` (a torn or forged file: the worker never counts past the
        run's steps) is shown as ``total_steps``, with a warning naming ``source`` and the field.

        :param task_index: the task the file belongs to.
        :param data: the decoded JSON.
        :param source: the file's name for the warning (default ``progress.json``).
        """
        if not isinstance(data, dict):
            return None
        step, total = data.get("step"), data.get("total_steps")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, total)):
            return None
        if step > total:
            log.warning("%s: step %d is beyond total_steps %d; shown as %d", source, step, total, total)
            step = total
        return cls(
            task_index=task_index, step=step, total_steps=total, status=str(data.get("status") or ""),
            updated_at=str(data.get("updated_at") or ""), loss=_number(data.get("loss")),
            steps_per_second=_number(data.get("steps_per_second")) or 0.0,
        )

    @property
    def eta_seconds(self) -> float | None:
        """Seconds left at the current rate: 0 when done, ``None`` when the rate is unknown."""
        left = max(0, self.total_steps - self.step)
        if left == 0:
            return 0.0
        return left / self.steps_per_second if self.steps_per_second > 0 else None

    def describe(self) -> str:
        """One log line, e.g. ``task 0: step 120/600 (20%), 3.1 steps/s, ETA 155 s, loss 0.412``."""
        percent = 100.0 * self.step / self.total_steps if self.total_steps else 100.0
        eta = self.eta_seconds
        text = f"task {self.task_index}: step {self.step}/{self.total_steps} ({percent:.0f}%)"
        text += f", {self.steps_per_second:g} steps/s, ETA " + ("unknown" if eta is None else f"{eta:.0f} s")
        if self.loss is not None:
            text += f", loss {self.loss:.4g}"
        return text + (f" [{self.status}]" if self.status else "")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, with ``eta_seconds`` (for XCom)."""
        return {**asdict(self), "eta_seconds": self.eta_seconds}


def most_lost_steps(resumed_from_step: Any, total_steps: int | None) -> int | None:
    """The most steps one resume can have lost: those of the run past the step it resumed from.

    A resume loses the steps between the checkpoint it loaded (a committed one) and the step the
    previous attempt had reached, and the worker never counts past the run's ``total_steps``: a
    real history stays within this bound.

    :param resumed_from_step: the entry's ``resumed_from_step`` (anything: an integer >= 0 is used).
    :param total_steps: the run's steps (``progress.json``), ``None`` when unknown.
    :return: ``total_steps`` less the resumed step (0 when it resumed at or past the end),
        ``total_steps`` when the resumed step is not a count, ``None`` without ``total_steps``.
    """
    if total_steps is None:
        return None
    resumed = non_negative_int(resumed_from_step)
    return total_steps if resumed is None else max(0, total_steps - resumed)


def lost_work_entries(task_index: int, data: Any, total_steps: int | None = None,
                      source: str = ATTEMPTS_FILE) -> list[dict[str, Any]]:
    """The attempts that lost work, from ``metrics.json`` or ``attempts.json``.

    ``lost_steps`` is the worker's claim, computed from an earlier ``progress.json``: a torn or
    forged file can make it absurd. It is bounded by :func:`most_lost_steps` (a warning names
    ``source``, the field and the entry); an entry left with nothing lost is dropped.

    :param task_index: the task the file belongs to.
    :param data: the decoded JSON: its ``attempts`` list, else its ``history`` list is read.
    :param total_steps: the run's steps (``progress.json``'s ``total_steps``); ``None``: unbounded.
    :param source: the file's name for the warning (default ``attempts.json``).
    :return: ``[{task_index, execution, attempt, resumed_from_step, lost_steps}]`` with
        ``lost_steps > 0``, in file order.
    """
    if not isinstance(data, dict):
        return []
    entries = data.get("attempts") or data.get("history") or []
    result = []
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not non_negative_int(entry.get("lost_steps")):
            continue
        lost, most = entry["lost_steps"], most_lost_steps(entry.get("resumed_from_step"), total_steps)
        if most is not None and lost > most:
            log.warning("%s: lost_steps %d of execution %s attempt %s (resumed from step %s) is more than the "
                        "run's total_steps %d allows; counted as %d", source, lost, entry.get("execution"),
                        entry.get("attempt"), entry.get("resumed_from_step"), total_steps, most)
            lost = most
        if lost > 0:
            result.append({
                "task_index": task_index, "execution": entry.get("execution"), "attempt": entry.get("attempt"),
                "resumed_from_step": entry.get("resumed_from_step"), "lost_steps": lost,
            })
    return result


_TASK_OBJECT_RE = re.compile(r"^task-(?P<index>\d+)/(?P<name>.+)$")


class CheckpointFilesHook:
    """Reads the worker's JSON files of one job's tasks from the checkpoint bucket; never raises.

    :param bucket: the checkpoint bucket (no ``gs://``).
    :param prefix: the folder of the job's task folders (usually the job name).
    :param gcp_conn_id: Airflow connection id for ``GCSHook`` (default ``google_cloud_default``).
    :param impersonation_chain: service account (or chain) to impersonate, or ``None``.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str,
        gcp_conn_id: str = "google_cloud_default",
        impersonation_chain: str | Sequence[str] | None = None,
    ) -> None:
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self._gcs_kwargs = {"gcp_conn_id": gcp_conn_id, "impersonation_chain": impersonation_chain}
        self._gcs: Any = None

    def object_name(self, task_index: int, file_name: str) -> str:
        """``{prefix}/task-{task_index}/{file_name}``."""
        return f"{self.prefix}/task-{task_index}/{file_name}"

    def read_json(self, task_index: int, file_name: str) -> Any:
        """The decoded JSON of one task file, or ``None`` if it is missing or unreadable."""
        try:
            raw = self._hook().download(bucket_name=self.bucket, object_name=self.object_name(task_index, file_name))
            return json.loads(raw)
        except Exception as exc:  # best effort by contract: progress must never fail the task
            log.debug("Cannot read gs://%s/%s: %s", self.bucket, self.object_name(task_index, file_name), exc)
            return None

    def _hook(self) -> Any:
        if self._gcs is None:
            from airflow.providers.google.cloud.hooks.gcs import GCSHook

            self._gcs = GCSHook(**self._gcs_kwargs)
        return self._gcs

    def task_checkpoints(self, retry: Retry | None = DEFAULT_RETRY) -> dict[int, TaskCheckpoints] | None:
        """Every task folder's committed steps and newer release's record, from one listing of
        ``{prefix}/task-*`` and a read of each commit record in it (see :func:`task_checkpoints`).

        :param retry: the Storage client's retry of each request (the listing's pages, each
            record): transient errors are retried with backoff until its timeout (default
            ``google.cloud.storage.retry.DEFAULT_RETRY``, the client's own, 120 s); ``None``: none.
        :return: task index -> :class:`TaskCheckpoints` (a task folder without objects is absent),
            or ``None`` when the bucket cannot be read. A task whose ``newer`` is set was refused
            by its worker (exit 78): report it as FATAL with ``newer.reason(task_index)``.
        """
        try:
            bucket = self._hook().get_conn().bucket(self.bucket)
            listings: dict[int, dict[str, int]] = {}
            for blob in bucket.list_blobs(prefix=f"{self.prefix}/task-", retry=retry):
                match = _TASK_OBJECT_RE.match(blob.name[len(self.prefix) + 1:])
                if match is not None:
                    listings.setdefault(int(match.group("index")), {})[match.group("name")] = int(blob.size or 0)

            def reader(index: int) -> Callable[[str], bytes | None]:
                def read(name: str) -> bytes | None:
                    try:
                        return bucket.blob(self.object_name(index, name)).download_as_bytes(retry=retry)
                    except NotFound:  # pruned by the worker since the listing
                        return None
                return read

            return {index: task_checkpoints(index, listing, reader(index)) for index, listing in listings.items()}
        except Exception as exc:  # best effort by contract: progress must never fail the task
            log.warning("Cannot list the checkpoints in gs://%s/%s: %s", self.bucket, self.prefix, exc)
            return None

    def committed_steps(self, retry: Retry | None = DEFAULT_RETRY) -> dict[int, int] | None:
        """The newest committed checkpoint step of every task that has one
        (:meth:`task_checkpoints`); a newer release's record is logged as a warning.

        :param retry: as for :meth:`task_checkpoints`.
        :return: task index -> step (tasks without a committed checkpoint absent); ``None`` when unreadable.
        """
        tasks = self.task_checkpoints(retry)
        if tasks is None:
            return None
        for index, task in sorted(tasks.items()):
            if task.newer is not None:
                log.warning("%s", task.newer.reason(index))
        return {index: task.steps[0] for index, task in tasks.items() if task.steps}

    def progress(self, task_index: int) -> TaskProgress | None:
        """The task's ``progress.json``, or ``None``."""
        return TaskProgress.from_json(task_index, self.read_json(task_index, PROGRESS_FILE),
                                      source=self._uri(task_index, PROGRESS_FILE))

    def lost_work(self, task_index: int) -> list[dict[str, Any]]:
        """The task's attempts that lost work (``metrics.json``, else ``attempts.json``), each
        bounded by the run's ``total_steps`` from ``progress.json`` (see :func:`lost_work_entries`)."""
        name, data = METRICS_FILE, self.read_json(task_index, METRICS_FILE)
        if not isinstance(data, dict):
            name, data = ATTEMPTS_FILE, self.read_json(task_index, ATTEMPTS_FILE)
        progress = self.progress(task_index)
        return lost_work_entries(task_index, data, None if progress is None else progress.total_steps,
                                 source=self._uri(task_index, name))

    def _uri(self, task_index: int, file_name: str) -> str:
        return f"gs://{self.bucket}/{self.object_name(task_index, file_name)}"

    def goodput_events(self, task_index: int) -> dict[tuple[str, int], dict[str, Any]]:
        """The task's goodput events files, by ``(execution, attempt)``; ``{}`` when unreadable.

        Files whose content has no string ``execution`` and integer ``attempt`` are skipped.
        """
        prefix = self.object_name(task_index, GOODPUT_PREFIX)
        try:
            names = sorted(self._hook().list(bucket_name=self.bucket, prefix=prefix))[-MAX_GOODPUT_FILES:]
        except Exception as exc:  # best effort, as every read here
            log.debug("Cannot list gs://%s/%s*: %s", self.bucket, prefix, exc)
            return {}
        return goodput_events_by_attempt(self.read_json(task_index, name.rsplit("/", 1)[-1]) for name in names)


def goodput_events_by_attempt(files: Iterable[Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """The goodput events files' contents (decoded JSON) by ``(execution, attempt)``; a content
    without a string ``execution`` and an integer ``attempt`` is skipped.

    :param files: the decoded files, oldest name first (a later one of the same attempt wins).
    """
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for data in files:
        execution, attempt = (data.get("execution"), data.get("attempt")) if isinstance(data, dict) else (None, None)
        if isinstance(execution, str) and isinstance(attempt, int) and not isinstance(attempt, bool):
            found[(execution, attempt)] = data
    return found

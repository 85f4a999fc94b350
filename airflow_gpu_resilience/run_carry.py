"""The bounds of a run's carry: what one try of the execute operator keeps of its executions.

The run state (:class:`~airflow_gpu_resilience.run_state.RunState`) travels through the trigger
as its ``carry`` (serialized into the trigger's row at every deferral) and ends in the summary
(the ``return_value`` XCom). Kept whole, it would grow with executions x tasks x attempts; these
pure functions keep it bounded by the task count, whatever the number of executions:

- attempts: the newest :data:`MAX_ATTEMPTS_PER_TASK` of each task and the newest
  :data:`MAX_LISTED_ATTEMPTS` in all are listed; every other one is counted, per task and class
  (:func:`bound_attempts`);
- executions: the newest :data:`MAX_EXECUTIONS_WITH_TASKS` keep their classified tasks; an older
  one keeps its name, state, action, reason, log URI and duration, and the number of its tasks in
  each class instead of the tasks (:func:`compact_executions`);
- per task, the attempts of all executions are summed as they are added
  (:func:`add_task_attempts`), so a task's attempt count stays exact.

A carry written by an earlier release (every attempt listed, every execution with its tasks, no
sums) is read by deriving the sums from it, then bounding it (:func:`upgrade`).

Pure: no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

__all__ = [
    "MAX_ATTEMPTS_PER_TASK",
    "MAX_EXECUTIONS_WITH_TASKS",
    "MAX_LISTED_ATTEMPTS",
    "add_task_attempts",
    "bound_attempts",
    "compact_executions",
    "upgrade",
]

#: Attempts listed per task (the newest); older ones are counted by class.
MAX_ATTEMPTS_PER_TASK = 8
#: Attempts listed in all (the newest), whatever the task count.
MAX_LISTED_ATTEMPTS = 1000
#: Executions (the newest) that keep their classified tasks in the carry and the summary.
MAX_EXECUTIONS_WITH_TASKS = 2


def bound_attempts(attempts: Sequence[Mapping[str, Any]], unlisted: MutableMapping[str, dict[str, int]],
                   per_task: int = MAX_ATTEMPTS_PER_TASK, total: int = MAX_LISTED_ATTEMPTS) -> list:
    """The attempts to keep listed; the others are counted into ``unlisted``.

    :param attempts: attempt entries (``task_index``, ``outcome``, ...), oldest first.
    :param unlisted: task index (as a string) -> class -> attempts not listed; updated in place.
    :param per_task: attempts kept per task (default :data:`MAX_ATTEMPTS_PER_TASK`).
    :param total: attempts kept in all (default :data:`MAX_LISTED_ATTEMPTS`).
    :return: the kept entries, oldest first (the same objects).
    """
    kept: list = []
    per: Counter = Counter()
    for entry in reversed(attempts):
        task = str(entry["task_index"])
        if per[task] < per_task and len(kept) < total:
            per[task] += 1
            kept.append(entry)
        else:
            counts = unlisted.setdefault(task, {})
            counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    return kept[::-1]


def compact_executions(executions: Sequence[MutableMapping[str, Any]],
                       keep: int = MAX_EXECUTIONS_WITH_TASKS) -> None:
    """Replace the tasks of all but the newest ``keep`` executions by their count per class.

    An entry compacted has ``tasks`` empty and ``task_outcomes`` (class -> tasks) set; entries
    are changed in place.

    :param executions: execution entries, oldest first.
    :param keep: executions that keep their tasks (default :data:`MAX_EXECUTIONS_WITH_TASKS`).
    """
    for entry in executions[:max(0, len(executions) - keep)]:
        if entry.get("tasks"):
            entry["task_outcomes"] = dict(Counter(task["outcome"] for task in entry["tasks"]))
            entry["tasks"] = []


def add_task_attempts(sums: MutableMapping[str, int], tasks: Iterable[Mapping[str, Any]]) -> None:
    """Add one execution's attempts per task (its classified tasks' ``attempts``) to ``sums``.

    :param sums: task index (as a string) -> attempts over the try's executions; updated in place.
    :param tasks: the execution's classified tasks (``index``, ``attempts``).
    """
    for task in tasks:
        sums[str(task["index"])] = sums.get(str(task["index"]), 0) + int(task["attempts"])


def upgrade(data: Mapping[str, Any]) -> dict[str, Any]:
    """A carry of any release in the current release's form, bounded.

    An earlier release's carry has no ``task_attempts`` or ``unlisted_attempts``: the sums are
    derived from its executions (all with their tasks then), and its lists are bounded.

    :param data: a ``RunState.to_dict()`` of this or an earlier release.
    :return: a new dict (the lists and entries in it are copies).
    """
    result = dict(data)
    executions = [dict(entry) for entry in data.get("executions", [])]
    if "task_attempts" not in data:
        sums: dict[str, int] = {}
        for entry in executions:
            add_task_attempts(sums, entry.get("tasks", []))
        result["task_attempts"] = sums
    unlisted = {task: dict(counts) for task, counts in data.get("unlisted_attempts", {}).items()}
    result["attempts"] = bound_attempts(list(data.get("attempts", [])), unlisted)
    result["unlisted_attempts"] = unlisted
    compact_executions(executions)
    result["executions"] = executions
    return result

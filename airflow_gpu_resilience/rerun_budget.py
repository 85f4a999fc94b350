"""The progress-aware re-run budget: re-run a preempted or timed-out execution, or stop, by checkpoint progress.

Pure: no I/O, no clocks. A task made progress in an execution when its newest committed
checkpoint step at the execution's end is greater than at its start (:class:`ExecutionProgress`).
A re-run after an execution with progress is free; ``max_reruns_without_progress`` re-runs in a
row without it end the Airflow task; ``max_total_reruns`` caps them all, for cost
(:func:`decide_rerun`).

**Unknown progress is not "no progress".** An execution whose steps could not be read (the
checkpoint bucket unreadable at the decision, or a start not recorded) neither resets nor adds to
the count of re-runs without progress, so a chain that was making progress goes on through a
bucket outage. The first ``max_unknown_progress`` such executions after the last one with
progress are passed over; later ones count as without progress, so a bucket that stays
unreadable still ends a run within ``max_unknown_progress + max_reruns_without_progress`` re-runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from airflow_gpu_resilience.outcome import Action, Decision, OutcomeClass, TaskOutcome, describe_task

__all__ = [
    "DEFAULT_MAX_RERUNS_WITHOUT_PROGRESS",
    "DEFAULT_MAX_TOTAL_RERUNS",
    "DEFAULT_MAX_UNKNOWN_PROGRESS",
    "ExecutionProgress",
    "ProgressBudget",
    "decide_rerun",
]

#: Default ``max_reruns_without_progress``: consecutive re-runs that commit no new checkpoint
#: before the Airflow task fails (NVIDIA's resiliency extension stops at a few as well).
DEFAULT_MAX_RERUNS_WITHOUT_PROGRESS = 2
#: Default ``max_total_reruns``, the cost cap on re-runs that do make progress. On the GA one-hour
#: GPU task timeout with ``max_retries`` 0 a day of training is 24 executions (23 re-runs) from
#: task timeouts alone; 48 leaves room for a maintenance preemption in every one of those hours,
#: so a job that keeps making progress is not stopped within its first day.
DEFAULT_MAX_TOTAL_RERUNS = 48
#: Default ``max_unknown_progress``: executions of unknown progress passed over after the last one
#: with progress (the execute operator passes its ``max_preemption_reruns``, default 3).
DEFAULT_MAX_UNKNOWN_PROGRESS = 3


@dataclass(frozen=True)
class ExecutionProgress:
    """The newest committed checkpoint step of each task at an execution's start and at its end.

    :param name: the execution's name (full or short).
    :param outcome: the execution's class, or ``None`` when not known.
    :param start_steps: task index -> newest committed step when the execution started (a task
        without a checkpoint is absent, i.e. step 0), or ``None`` when not recorded.
    :param end_steps: the same at the execution's end, or ``None`` when not known.
    """

    name: str
    outcome: OutcomeClass | None
    start_steps: Mapping[int, int] | None
    end_steps: Mapping[int, int] | None

    @property
    def made_progress(self) -> bool | None:
        """Whether any task's newest committed step grew; ``None`` when a side is unknown."""
        if self.start_steps is None or self.end_steps is None:
            return None
        return any(step > self.start_steps.get(index, 0) for index, step in self.end_steps.items())

    def steps_text(self) -> str:
        """``"task 0: 40 -> 120, task 1: 38 -> 110"`` (the first 4 tasks), ``"?"`` when unknown."""
        if self.start_steps is None or self.end_steps is None:
            return "?"
        indexes = sorted(set(self.start_steps) | set(self.end_steps))
        parts = [f"task {i}: {self.start_steps.get(i, 0)} -> {self.end_steps.get(i, 0)}" for i in indexes[:4]]
        return ", ".join(parts + ([f"... ({len(indexes)} tasks)"] if len(indexes) > 4 else [])) or "no checkpoint"


@dataclass(frozen=True)
class ProgressBudget:
    """The progress-aware re-run budget of one Airflow task instance.

    :param history: every execution of the task instance, oldest first, the one just finished
        last (all Airflow tries, as Cloud Run lists them).
    :param max_reruns_without_progress: consecutive re-runs without a new committed checkpoint
        allowed (an integer >= 0; default :data:`DEFAULT_MAX_RERUNS_WITHOUT_PROGRESS`).
    :param max_total_reruns: re-runs allowed in total, with or without progress (cost cap; an
        integer >= 0; default :data:`DEFAULT_MAX_TOTAL_RERUNS`).
    :param max_unknown_progress: executions of unknown progress passed over (neither progress nor
        no progress) after the last one with progress; later ones count as without progress (an
        integer >= 0; default :data:`DEFAULT_MAX_UNKNOWN_PROGRESS`).
    """

    history: Sequence[ExecutionProgress]
    max_reruns_without_progress: int = DEFAULT_MAX_RERUNS_WITHOUT_PROGRESS
    max_total_reruns: int = DEFAULT_MAX_TOTAL_RERUNS
    max_unknown_progress: int = DEFAULT_MAX_UNKNOWN_PROGRESS

    def without_progress(self) -> list[ExecutionProgress]:
        """The executions after the last one with progress that count as without it, oldest first:
        those without progress, and those of unknown progress after the first
        ``max_unknown_progress`` of them (which are passed over)."""
        since = len(self.history)
        while since > 0 and not self.history[since - 1].made_progress:
            since -= 1
        streak: list[ExecutionProgress] = []
        unknown = 0
        for entry in self.history[since:]:
            if entry.made_progress is None:
                unknown += 1
                if unknown <= self.max_unknown_progress:
                    continue
            streak.append(entry)
        return streak

    def reruns_without_progress(self) -> int:
        """Re-runs that count as without progress: the :meth:`without_progress` executions, less
        the first execution of the task instance (not a re-run) when it is one of them."""
        streak = self.without_progress()
        return len(streak) - (1 if streak and self.history and streak[0] is self.history[0] else 0)

    def decide(self, task: TaskOutcome, reruns_used: int) -> Decision:
        """:func:`decide_rerun` with this budget."""
        return decide_rerun(task, reruns_used, self)


def decide_rerun(task: TaskOutcome, reruns_used: int, progress: ProgressBudget) -> Decision:
    """Re-run a PREEMPTED/TIMED_OUT execution, or stop, by checkpoint progress.

    The rule: stop when the execution just finished counts as without progress (see
    :meth:`ProgressBudget.without_progress`: no newer checkpoint than the one it started from, or
    its progress unknown beyond ``max_unknown_progress``) and ``max_reruns_without_progress``
    re-runs in a row did (the error names the step it is stuck at, the classes of those executions
    and what to check); else stop when ``reruns_used`` reached ``max_total_reruns``; else re-run.
    A re-run after an execution with progress, or of unknown progress within the bound, does not
    count against ``max_reruns_without_progress``.

    :param task: the task that decided the execution's class (PREEMPTED or TIMED_OUT).
    :param reruns_used: re-runs already started for the Airflow task (all tries).
    :param progress: the history and the limits.
    :return: RERUN or FAIL_NO_RETRY.
    """
    what = "preempted" if task.outcome is OutcomeClass.PREEMPTED else "timed out"
    last = progress.history[-1] if progress.history else None
    streak = progress.without_progress()
    stuck = progress.reruns_without_progress()
    limit = progress.max_reruns_without_progress
    if stuck >= limit and last is not None and streak and streak[-1] is last:
        classes = ", ".join(e.outcome.value if e.outcome else "?" for e in streak)
        unknown = sum(1 for e in streak if e.made_progress is None)
        return Decision(
            Action.FAIL_NO_RETRY, task.outcome,
            f"{describe_task(task)}: {what}; no new committed checkpoint in the last {len(streak)} execution(s) "
            f"({stuck} re-run(s) without progress, max_reruns_without_progress={limit}"
            + (f"; {unknown} of them of unknown progress, beyond max_unknown_progress="
               f"{progress.max_unknown_progress}" if unknown else "")
            + f"): stuck at {_stuck_text(progress.history)}; their classes: {classes}. Check that a checkpoint commits well "
            "within one attempt: the checkpoint interval against the task timeout (TASK_TIMEOUT_SECONDS) "
            "and against the time between preemptions" + (", and that the checkpoint bucket can be read" if unknown
                                                            else ""),
            task,
        )
    if reruns_used >= progress.max_total_reruns:
        return Decision(
            Action.FAIL_NO_RETRY, task.outcome,
            f"{describe_task(task)}: {what}; total re-run cap reached ({reruns_used} re-runs used, "
            f"max_total_reruns={progress.max_total_reruns})",
            task,
        )
    return Decision(
        Action.RERUN, task.outcome,
        f"{describe_task(task)}: {what}; {_why_rerun(last, stuck, limit)}; re-run {reruns_used + 1} (at most "
        f"{progress.max_total_reruns} in total) resumes from the checkpoint",
        task,
    )


def _why_rerun(last: ExecutionProgress | None, stuck: int, limit: int) -> str:
    """Why the execution just finished is re-run, for the decision's reason."""
    if last is not None and last.made_progress:
        return f"it made progress ({last.steps_text()}), so the re-run is free of max_reruns_without_progress"
    if last is not None and last.made_progress is False:
        return (f"no progress ({last.steps_text()}); re-run {stuck + 1} of {limit} without progress "
                f"(max_reruns_without_progress)")
    return ("its progress is unknown, which is neither progress nor no progress; "
            f"{stuck} re-run(s) without progress so far (max_reruns_without_progress={limit})")


def _stuck_text(history: Sequence[ExecutionProgress]) -> str:
    """The newest committed steps known in ``history`` (an end, else a start), for the stop's reason."""
    known = ((e.end_steps, e.start_steps) for e in reversed(history))
    steps = next((end if end is not None else start for end, start in known if (end, start) != (None, None)), None)
    if steps is None:
        return "an unknown step (the checkpoint bucket could not be read)"
    if not steps:
        return "step 0 (no committed checkpoint yet)"
    if len(steps) == 1:
        [(index, step)] = steps.items()
        return f"step {step} (task {index})"
    parts = [f"task {i}: step {steps[i]}" for i in sorted(steps)[:4]]
    return ", ".join(parts) + (f", ... ({len(steps)} tasks)" if len(steps) > 4 else "")

"""The goodput account of one Airflow task: where every second of its Cloud Run attempts went.

Pure functions, no I/O. Inputs are, per Cloud Run task index, its attempts over every execution
of the Airflow task (:class:`AttemptInput`): the platform's times where Cloud Run gives them
(a ``run_v2.Task`` keeps ``start_time``/``completion_time`` of its latest attempt only) and the
worker's goodput events file (``goodput-{execution}-{attempt}.json``, see the worker's
``gpu_resilience_worker.goodput``). The account covers the task's span, from its first
attempt's start to its last attempt's end, and puts each second in exactly one bucket:

``productive``
    training steps that advanced the run (an attempt's time after its first step, less the
    three buckets below).
``startup``
    an attempt's start (container start, as Cloud Run reports it) to its first training step,
    less the restore; all of an attempt that never reached its first step.
``restore``
    loading the checkpoint the attempt resumed from.
``save_stall``
    time the training loop was blocked by checkpoint saves (the blocking part of a background
    save, or a whole synchronous one, and the wait for a save in flight at a stop).
``wasted``
    steps computed again after a resume: ``steps_recomputed`` (steps earlier attempts had done
    past the checkpoint it resumed from, up to the highest step any of them reached) times the
    attempt's measured ``step_seconds``;
    and, for a task that ended without finishing (a failed task: ``durable_step`` given), every
    step computed past the newest committed checkpoint, latest attempts first
    (``steps_uncommitted``): nothing will resume them in this account.
``recovery_gap``
    between one attempt's end and the next attempt's start (retry delay, a re-run execution
    being started, scheduling); also the time of an attempt whose times are unknown.

Rules for imperfect histories: an attempt's start is the platform's, else the worker's
``process_start``; its end the platform's, else the worker's ``ended_at``, else its last
``updated_at`` (a killed worker writes no end); an attempt with neither is left out (its time
falls into the recovery gap, and ``unknown_attempts`` counts it). Attempts are ordered by start;
one that starts before the previous one ended is clipped to start at that end, so no second is
counted twice. Events outside the attempt are clamped into it. The buckets therefore always
add up to the span. ``gpu_seconds`` is what Cloud Run bills: every attempt's whole wall time
(unclipped) times the GPUs per task; recovery gaps are not billed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict

#: The buckets, in table order.
BUCKETS = ("productive", "startup", "restore", "save_stall", "wasted", "recovery_gap")


class AttemptAccount(TypedDict):
    """One attempt's share of the account (seconds)."""

    execution: str
    attempt: int
    start: float
    end: float
    wall_seconds: float
    productive: float
    startup: float
    restore: float
    save_stall: float
    wasted: float
    steps_recomputed: int
    steps_uncommitted: int
    """Steps past the newest committed checkpoint, counted as wasted (the last training attempt of
    a task accounted with ``durable_step``; 0 otherwise)."""
    step_seconds: float | None
    reached_first_step: bool
    times_from: str
    """``platform`` or ``worker`` (where start and end came from)."""


class GoodputAccount(TypedDict):
    """The account of one Cloud Run task index, or the total of several (``task_index`` -1).

    Bucket values are seconds; ``span_seconds`` is their sum.
    """

    task_index: int
    productive: float
    startup: float
    restore: float
    save_stall: float
    wasted: float
    recovery_gap: float
    span_seconds: float
    attempt_seconds: float
    """Sum of the attempts' (clipped) wall times: ``span_seconds`` less ``recovery_gap``."""
    gpu_seconds: float
    goodput: float | None
    """``productive / span_seconds``; ``None`` for an empty span."""
    steps_recomputed: int
    steps_uncommitted: int
    attempts: list[AttemptAccount]
    unknown_attempts: int


@dataclasses.dataclass(frozen=True)
class AttemptInput:
    """One attempt as the operator knows it.

    :param execution: the execution's short id (``CLOUD_RUN_EXECUTION``).
    :param attempt: 0-based attempt number within the execution.
    :param start: the platform's start time (epoch seconds), or ``None`` when Cloud Run does not say.
    :param end: the platform's end time (epoch seconds), or ``None``.
    :param events: the worker's goodput events (decoded JSON), or ``None`` when missing.
    """

    execution: str
    attempt: int
    start: float | None = None
    end: float | None = None
    events: Mapping[str, Any] | None = None


def _num(events: Mapping[str, Any], key: str) -> float | None:
    """A finite number from the events, else ``None`` (a missing, mistyped, NaN or infinite value)."""
    value = events.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _events(item: AttemptInput) -> Mapping[str, Any]:
    """The attempt's events, ``{}`` when missing or not a mapping (a torn or foreign file)."""
    return item.events if isinstance(item.events, Mapping) else {}


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _times(item: AttemptInput) -> tuple[float | None, float | None, str]:
    events = _events(item)
    start, end, source = _finite(item.start), _finite(item.end), "platform"
    if start is None:
        start, source = _num(events, "process_start"), "worker"
    if end is None:
        end = _num(events, "ended_at")
        if end is None:
            end = _num(events, "updated_at")
        source = "worker"
    return start, end, source


def _attempt(item: AttemptInput, start: float, end: float, source: str) -> AttemptAccount:
    """Split ``[start, end]`` of one attempt into its five in-attempt buckets (they sum to the wall)."""
    events = _events(item)
    wall = max(0.0, end - start)
    first = _num(events, "first_step_at")
    reached = first is not None and first < end
    before = wall if not reached else _clamp(first - start, 0.0, wall)  # type: ignore[operator]
    r0, r1 = _num(events, "restore_start"), _num(events, "restore_end")
    restore = 0.0
    if r0 is not None and r1 is not None and r1 > r0:
        restore = max(0.0, min(r1, start + before) - max(r0, start))
    after = wall - before
    save = _clamp(_num(events, "save_blocking_seconds") or 0.0, 0.0, after)
    step_seconds = _num(events, "step_seconds")
    recomputed = max(0, int(_num(events, "steps_recomputed") or 0))
    steps = max(0, int(_num(events, "steps") or 0))
    wasted = 0.0
    if reached and step_seconds is not None and step_seconds > 0:
        wasted = _clamp(min(recomputed, steps) * step_seconds, 0.0, after - save)
    return AttemptAccount(
        execution=item.execution, attempt=item.attempt, start=start, end=end, wall_seconds=wall,
        productive=after - save - wasted, startup=before - restore, restore=restore, save_stall=save,
        wasted=wasted, steps_recomputed=recomputed if reached else 0, steps_uncommitted=0,
        step_seconds=step_seconds, reached_first_step=reached, times_from=source,
    )


def _lose_uncommitted(rows: list[AttemptAccount], inputs: list[AttemptInput], durable_step: int) -> None:
    """For a task that ended without finishing: move every step computed past ``durable_step``
    from productive to wasted, latest attempts first.

    The steps that advanced the run are those of the first training attempt's resume step up to
    ``durable_step``; each attempt's other steps were either recomputed (already wasted) or are
    new ("fresh"). Fresh steps beyond what was kept are lost: also those of an earlier attempt
    that no later attempt got back to, which no ``steps_recomputed`` ever counts.
    """
    trained = [(row, _events(item)) for row, item in zip(rows, inputs) if row["reached_first_step"]]
    first_resumed = _num(trained[0][1], "resumed_from_step") if trained else None
    if first_resumed is None:
        return
    fresh = []
    for row, events in trained:
        steps = max(0, int(_num(events, "steps") or 0))
        fresh.append(steps - min(row["steps_recomputed"], steps))
    excess = sum(fresh) - max(0, durable_step - int(first_resumed))
    for (row, _), new in zip(reversed(trained), reversed(fresh)):
        if excess <= 0:
            break
        lost = min(excess, new)
        excess -= lost
        step_seconds = row["step_seconds"]
        if lost and step_seconds and step_seconds > 0:  # an attempt without a step time keeps its seconds
            seconds = min(lost * step_seconds, row["productive"])
            row["productive"] -= seconds
            row["wasted"] += seconds
            row["steps_uncommitted"] = lost


def account_task(task_index: int, attempts: Iterable[AttemptInput], gpus_per_task: int = 1,
                 durable_step: int | None = None) -> GoodputAccount:
    """The account of one Cloud Run task index over all its attempts.

    :param task_index: the task index (for the result).
    :param attempts: its attempts, in any order.
    :param gpus_per_task: GPUs per task instance (billing), default 1.
    :param durable_step: for a task that ended without finishing (the Airflow task failed): the
        step of its newest committed checkpoint (0: none). The last training attempt's steps past
        it are wasted (``steps_uncommitted``). ``None`` (default): the task finished, or it is
        not known; nothing is moved.
    :return: the account; empty (all zero, ``goodput`` ``None``) with no timed attempt.
    :raises ValueError: ``gpus_per_task`` below 0, or ``durable_step`` not an integer >= 0.
    """
    if isinstance(gpus_per_task, bool) or not isinstance(gpus_per_task, int) or gpus_per_task < 0:
        raise ValueError(f"gpus_per_task={gpus_per_task!r} must be an integer >= 0")
    if durable_step is not None and (isinstance(durable_step, bool) or not isinstance(durable_step, int)
                                     or durable_step < 0):
        raise ValueError(f"durable_step={durable_step!r} must be an integer >= 0 or None")
    timed, unknown, billed = [], 0, 0.0
    for item in attempts:
        start, end, source = _times(item)
        if start is None or end is None or end < start:
            unknown += 1
            continue
        billed += end - start
        timed.append((start, end, source, item))
    timed.sort(key=lambda t: (t[0], t[3].execution, t[3].attempt))
    rows: list[AttemptAccount] = []
    gap, previous_end = 0.0, None
    for start, end, source, item in timed:
        if previous_end is not None:
            gap += max(0.0, start - previous_end)
            start = max(start, previous_end)
            end = max(end, start)
        rows.append(_attempt(item, start, end, source))
        previous_end = end if previous_end is None else max(previous_end, end)
    if durable_step is not None:
        _lose_uncommitted(rows, [t[3] for t in timed], durable_step)
    totals = {b: sum(r[b] for r in rows) for b in BUCKETS if b != "recovery_gap"}  # type: ignore[literal-required]
    span = (previous_end - timed[0][0]) if timed else 0.0
    return GoodputAccount(
        task_index=task_index, **totals, recovery_gap=gap, span_seconds=span,  # type: ignore[typeddict-item]
        attempt_seconds=sum(r["wall_seconds"] for r in rows), gpu_seconds=billed * gpus_per_task,
        goodput=(totals["productive"] / span) if span > 0 else None,
        steps_recomputed=sum(r["steps_recomputed"] for r in rows),
        steps_uncommitted=sum(r["steps_uncommitted"] for r in rows), attempts=rows, unknown_attempts=unknown,
    )


def total(accounts: Sequence[GoodputAccount]) -> GoodputAccount:
    """The sum of several tasks' accounts (``task_index`` -1; spans add up, as task-seconds)."""
    sums = {key: sum(a[key] for a in accounts) for key in (*BUCKETS, "span_seconds", "attempt_seconds",  # type: ignore[literal-required]
                                                             "gpu_seconds")}
    return GoodputAccount(
        task_index=-1, **sums,  # type: ignore[typeddict-item]
        goodput=(sums["productive"] / sums["span_seconds"]) if sums["span_seconds"] > 0 else None,
        steps_recomputed=sum(a["steps_recomputed"] for a in accounts),
        steps_uncommitted=sum(a.get("steps_uncommitted", 0) for a in accounts), attempts=[],
        unknown_attempts=sum(a["unknown_attempts"] for a in accounts),
    )


def format_table(accounts: Sequence[GoodputAccount]) -> str:
    """A fixed-width table: one row per task (and a total row for several), seconds and shares.

    :param accounts: per-task accounts.
    :return: the table's lines joined by newlines (no trailing newline).
    """
    rows = list(accounts) + ([total(accounts)] if len(accounts) > 1 else [])
    head = f"{'task':>5} " + " ".join(f"{b:>12}" for b in BUCKETS) + f" {'span':>9} {'GPU-s':>9} {'goodput':>8}"
    lines = [head]
    for a in rows:
        name = "all" if a["task_index"] < 0 else str(a["task_index"])
        span = a["span_seconds"]
        cells = " ".join(f"{a[b]:7.1f} {100 * a[b] / span if span else 0:3.0f}%" for b in BUCKETS)  # type: ignore[literal-required]
        share = "-" if a["goodput"] is None else f"{100 * a['goodput']:.1f}%"
        lines.append(f"{name:>5} {cells} {span:9.1f} {a['gpu_seconds']:9.1f} {share:>8}")
    return "\n".join(lines)


def describe(accounts: Sequence[GoodputAccount]) -> str:
    """One sentence for an error message or a log line: what the tasks' attempts cost and where it went.

    For a failed task, the figure its users look for: the GPU-seconds billed and how many of
    the span's seconds trained anything.

    :param accounts: per-task accounts (:func:`account_task`), possibly empty.
    :return: e.g. ``"Goodput account: 41.0 GPU-s billed over 3 attempt(s) of 1 task(s); productive
        0.0 s of a 45.2 s span (goodput 0.0 %); startup 38.0 s, restore 0.0 s, save_stall 0.0 s,
        wasted 0.0 s (0 steps recomputed), recovery_gap 4.2 s."``; an account with no timed
        attempt says so.
    """
    whole = total(accounts)
    attempts = sum(len(a["attempts"]) for a in accounts)
    unknown = f", {whole['unknown_attempts']} more without known times" if whole["unknown_attempts"] else ""
    if attempts == 0:
        without = f" ({whole['unknown_attempts']} attempt(s) without times)" if whole["unknown_attempts"] else ""
        return f"Goodput account: no attempt with known times in {len(accounts)} task(s){without}."
    share = "-" if whole["goodput"] is None else f"{100 * whole['goodput']:.1f} %"
    lost = f", {whole['steps_uncommitted']} uncommitted" if whole["steps_uncommitted"] else ""
    rest = ", ".join(f"{b} {whole[b]:.1f} s"  # type: ignore[literal-required]
                     + (f" ({whole['steps_recomputed']} steps recomputed{lost})" if b == "wasted" else "")
                     for b in BUCKETS[1:])
    return (f"Goodput account: {whole['gpu_seconds']:.1f} GPU-s billed over {attempts} attempt(s) of "
            f"{len(accounts)} task(s){unknown}; productive {whole['productive']:.1f} s of a "
            f"{whole['span_seconds']:.1f} s span (goodput {share}); {rest}.")

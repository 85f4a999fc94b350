"""The goodput account of one Airflow task: where every second of its Cloud Run attempts went.

Pure functions, no I/O. Inputs are, per Cloud Run task index, its attempts over every execution
of the Airflow task (:class:`AttemptInput`): what Cloud Run says of them and the worker's goodput
events file (``goodput-{execution}-{attempt}.json``, see the worker's
``gpu_resilience_worker.attempt``).

**What is billed comes from Cloud Run; the worker's events only split it.** Cloud Run ran every
attempt it counts (``run_v2.Task.retried`` + 1 per execution), but its API keeps the times of a
task's latest attempt only (``start_time``/``completion_time``) and the task's
``scheduled_time``. The worker times the attempts it ran far enough to write its events file
(it writes it at its checkpoint restore, then at most once a second). So:

- an attempt's times are the platform's where it gives them, else the worker's (``process_start``
  to ``ended_at``);
- attempts with neither (stopped in their start-up, before their worker wrote anything) lie
  between the timed attempts around them in their execution (the first ones after the task's
  scheduled time): a run of them gets all the time between, in equal shares, billed, all of it
  ``startup`` (``times_from`` ``inferred``). This bound is from above: it includes the retry
  delays between them, which Cloud Run does not report;
- a killed worker writes no ``ended_at``; its last ``updated_at`` is only a lower bound of its
  end, so the attempt runs on to the next attempt's start in its execution (attempts without
  times right after it take that time instead), and the seconds after its last write are
  ``wasted`` (``startup`` before its first step): nothing it did then left a record; only an
  end the platform or the worker recorded proves a gap that was not billed;
- an attempt that cannot be placed (no times, and no timed attempt after it in its execution)
  is left out and counted in ``unknown_attempts``.

The account covers the task's span, from its first attempt's start to its last attempt's end,
and puts each second in exactly one bucket:

``productive``
    training steps that advanced the run (an attempt's time after its first step, less the
    three buckets below). For a task that ended without finishing (``durable_step`` given), only
    the steps a committed checkpoint kept count: see :func:`account_task`.
``startup``
    an attempt's start (container start, as Cloud Run reports it) to its first training step,
    less the restore; all of an attempt that never reached its first step, or left no events.
    ml-goodput-measurement counts the re-initialisation after a restart has begun (its
    ``TPU_INITIALIZATION``, ``TRAINING_PREP``, ``PROGRAM_STARTUP``) apart from the downtime
    before it (``INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION``); an attempt Cloud Run started is
    past that beginning, so an attempt without events is start-up, not recovery.
``restore``
    loading the checkpoint the attempt resumed from.
``save_stall``
    time the training loop was blocked by checkpoint saves (the blocking part of a background
    save, or a whole synchronous one, and the wait for a save in flight at a stop).
``wasted``
    steps computed again after a resume: ``steps_recomputed`` (steps earlier attempts had done
    past the checkpoint it resumed from, up to the highest step any of them reached) times the
    attempt's measured ``step_seconds``; for a task that ended without finishing, every
    training second no committed checkpoint kept (``steps_uncommitted``); and a killed
    attempt's seconds after its last write.
``recovery_gap``
    between one attempt's end and the next attempt's start where the two are known (retry
    delay, a re-run execution being started, scheduling); not billed.

Attempts are ordered by start; one that starts before the previous one ended is clipped to start
at that end, so no second is counted twice. Events outside the attempt are clamped into it. The
buckets therefore always add up to the span. ``gpu_seconds`` is what Cloud Run bills: every
placed attempt's whole wall time (unclipped) times the GPUs per task. The shares shown
(:func:`shares`) are whole percentages that add up to exactly 100.
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
    """Fresh steps no committed checkpoint kept, counted as wasted (a task accounted with
    ``durable_step``; 0 otherwise)."""
    step_seconds: float | None
    reached_first_step: bool
    times_from: str
    """``platform``, ``worker`` (where start and end came from) or ``inferred`` (an attempt
    without times, placed between its neighbours)."""


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
    inferred_attempts: int
    """Attempts without times of their own, placed (and billed) between their neighbours."""


@dataclasses.dataclass(frozen=True)
class AttemptInput:
    """One attempt as the operator knows it.

    :param execution: the execution's short id (``CLOUD_RUN_EXECUTION``).
    :param attempt: 0-based attempt number within the execution.
    :param start: the platform's start time (epoch seconds), or ``None`` when Cloud Run does not say.
    :param end: the platform's end time (epoch seconds), or ``None``.
    :param events: the worker's goodput events (decoded JSON), or ``None`` when missing.
    :param scheduled: the task's ``scheduled_time`` in this execution (epoch seconds): no attempt
        of it started earlier. ``None`` when unknown (then attempts without times before the first
        timed one cannot be placed).
    """

    execution: str
    attempt: int
    start: float | None = None
    end: float | None = None
    events: Mapping[str, Any] | None = None
    scheduled: float | None = None


@dataclasses.dataclass
class _Slot:
    """One placed attempt: its times (``tail``: seconds after a killed worker's last write)."""

    item: AttemptInput
    start: float
    end: float
    source: str
    tail: float = 0.0


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
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _times(item: AttemptInput) -> tuple[float | None, float | None, str, bool]:
    """``(start, end, source, end_proven)``: the platform's times, else the worker's; the end is
    proven unless it is only the worker's last write (a killed worker)."""
    events = _events(item)
    start, end, source = _finite(item.start), _finite(item.end), "platform"
    if start is None:
        start, source = _num(events, "process_start"), "worker"
    if end is not None:
        return start, end, source, True
    end = _num(events, "ended_at")
    if end is not None:
        return start, end, "worker", True
    return start, _num(events, "updated_at"), "worker", False


def _place(items: list[AttemptInput]) -> tuple[list[_Slot], int]:
    """Time the attempts of one task in one execution (see the module docstring).

    :param items: the execution's attempts of the task.
    :return: the placed attempts and how many could not be placed.
    """
    bounds = [s for s in (_finite(i.scheduled) for i in items) if s is not None]
    cursor = min(bounds) if bounds else None
    slots: list[_Slot] = []
    pending: list[AttemptInput] = []
    unknown, killed = 0, None
    for item in sorted(items, key=lambda i: i.attempt):
        start, end, source, proven = _times(item)
        if start is None or end is None or end < start:
            pending.append(item)
            continue
        if pending:
            if cursor is not None and cursor <= start:
                share = (start - cursor) / len(pending)
                slots += [_Slot(p, cursor + k * share, cursor + (k + 1) * share, "inferred")
                          for k, p in enumerate(pending)]
            else:
                unknown += len(pending)
            pending = []
        elif killed is not None and start > killed.end:
            killed.tail, killed.end = start - killed.end, start
        slots.append(_Slot(item, start, end, source))
        killed, cursor = (None if proven else slots[-1]), end
    return slots, unknown + len(pending)


def _attempt(slot: _Slot, start: float, end: float) -> AttemptAccount:
    """Split ``[start, end]`` of one attempt into its five in-attempt buckets (they sum to the wall)."""
    item, events = slot.item, _events(slot.item)
    wall = max(0.0, end - start)
    tail = _clamp(slot.tail, 0.0, wall)
    recorded = wall - tail
    first = _num(events, "first_step_at")
    reached = first is not None and first < end - tail
    before = recorded if not reached else _clamp(first - start, 0.0, recorded)  # type: ignore[operator]
    r0, r1 = _num(events, "restore_start"), _num(events, "restore_end")
    restore = 0.0
    if r0 is not None and r1 is not None and r1 > r0:
        restore = max(0.0, min(r1, start + before) - max(r0, start))
    after = recorded - before
    save = _clamp(_num(events, "save_blocking_seconds") or 0.0, 0.0, after)
    step_seconds = _num(events, "step_seconds")
    recomputed = max(0, int(_num(events, "steps_recomputed") or 0))
    steps = max(0, int(_num(events, "steps") or 0))
    wasted = 0.0
    if reached and step_seconds is not None and step_seconds > 0:
        wasted = _clamp(min(recomputed, steps) * step_seconds, 0.0, after - save)
    return AttemptAccount(
        execution=item.execution, attempt=item.attempt, start=start, end=end, wall_seconds=wall,
        productive=after - save - wasted, startup=before - restore + (0.0 if reached else tail), restore=restore,
        save_stall=save, wasted=wasted + (tail if reached else 0.0), steps_recomputed=recomputed if reached else 0,
        steps_uncommitted=0, step_seconds=step_seconds, reached_first_step=reached, times_from=slot.source,
    )


def _keep_committed(rows: list[AttemptAccount], inputs: list[AttemptInput], durable_step: int) -> None:
    """For a task that ended without finishing: productive seconds only for steps a committed
    checkpoint kept; every other training second is wasted.

    The run kept ``durable_step - R`` steps, ``R`` being the step its first training attempt
    resumed from (0 when not recorded: the most it can have kept). Each training attempt's fresh
    steps (its steps less those it recomputed) are kept oldest attempt first; an attempt keeps
    the share of its productive seconds that its kept steps are of its fresh ones (none when it
    did no fresh step), and its other fresh steps are ``steps_uncommitted``. So a task that
    never committed a checkpoint has no productive second.
    """
    trained = [(row, _events(item)) for row, item in zip(rows, inputs) if row["reached_first_step"]]
    if not trained:
        return
    keep = max(0, durable_step - int(_num(trained[0][1], "resumed_from_step") or 0))
    for row, events in trained:
        steps = max(0, int(_num(events, "steps") or 0))
        fresh = steps - min(row["steps_recomputed"], steps)
        kept = min(fresh, keep)
        keep -= kept
        moved = row["productive"] * (1.0 - (kept / fresh if fresh else 0.0))
        row["productive"] -= moved
        row["wasted"] += moved
        row["steps_uncommitted"] = fresh - kept


def _check(gpus_per_task: int, durable_step: int | None) -> None:
    if isinstance(gpus_per_task, bool) or not isinstance(gpus_per_task, int) or gpus_per_task < 0:
        raise ValueError(f"gpus_per_task={gpus_per_task!r} must be an integer >= 0")
    if durable_step is not None and (isinstance(durable_step, bool) or not isinstance(durable_step, int)
                                     or durable_step < 0):
        raise ValueError(f"durable_step={durable_step!r} must be an integer >= 0 or None")


def account_task(task_index: int, attempts: Iterable[AttemptInput], gpus_per_task: int = 1,
                 durable_step: int | None = None) -> GoodputAccount:
    """The account of one Cloud Run task index over all its attempts.

    :param task_index: the task index (for the result).
    :param attempts: its attempts, in any order.
    :param gpus_per_task: GPUs per task instance (billing), default 1.
    :param durable_step: for a task that ended without finishing (the Airflow task failed): the
        step of its newest committed checkpoint (0: none). Only the steps it kept are productive
        (see :func:`_keep_committed`); the rest of the training time is wasted
        (``steps_uncommitted`` counts the steps). ``None`` (default): the task finished, or it
        is not known; nothing is moved.
    :return: the account; empty (all zero, ``goodput`` ``None``) with no placed attempt.
    :raises ValueError: ``gpus_per_task`` below 0, or ``durable_step`` not an integer >= 0.
    """
    _check(gpus_per_task, durable_step)
    by_execution: dict[str, list[AttemptInput]] = {}
    for item in attempts:
        by_execution.setdefault(item.execution, []).append(item)
    slots: list[_Slot] = []
    unknown = 0
    for items in by_execution.values():
        placed, missing = _place(items)
        slots += placed
        unknown += missing
    billed = sum(s.end - s.start for s in slots)
    slots.sort(key=lambda s: (s.start, s.item.execution, s.item.attempt))
    rows: list[AttemptAccount] = []
    gap, previous_end = 0.0, None
    for slot in slots:
        start, end = slot.start, slot.end
        if previous_end is not None:
            gap += max(0.0, start - previous_end)
            start = max(start, previous_end)
            end = max(end, start)
        rows.append(_attempt(slot, start, end))
        previous_end = end if previous_end is None else max(previous_end, end)
    if durable_step is not None:
        _keep_committed(rows, [s.item for s in slots], durable_step)
    totals = {b: sum(r[b] for r in rows) for b in BUCKETS if b != "recovery_gap"}  # type: ignore[literal-required]
    span = (previous_end - slots[0].start) if slots else 0.0
    return GoodputAccount(
        task_index=task_index, **totals, recovery_gap=gap, span_seconds=span,  # type: ignore[typeddict-item]
        attempt_seconds=sum(r["wall_seconds"] for r in rows), gpu_seconds=billed * gpus_per_task,
        goodput=(totals["productive"] / span) if span > 0 else None,
        steps_recomputed=sum(r["steps_recomputed"] for r in rows),
        steps_uncommitted=sum(r["steps_uncommitted"] for r in rows), attempts=rows, unknown_attempts=unknown,
        inferred_attempts=sum(s.source == "inferred" for s in slots),
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
        inferred_attempts=sum(a.get("inferred_attempts", 0) for a in accounts),
    )


def shares(values: Sequence[float]) -> list[int]:
    """Whole percentages of ``values`` in their sum that add up to exactly 100.

    Largest remainder (Hamilton's method): each value gets the floor of its exact share, then
    the values with the largest remainders one point more each (ties: the earlier value) until
    the points add up to 100. A zero sum gives all zeros.

    :param values: amounts (e.g. the buckets' seconds), each finite and >= 0.
    :return: one percentage per value, in order.
    :raises ValueError: a negative or non-finite value.
    """
    if any(not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0) for v in values):
        raise ValueError(f"values={list(values)!r} must all be finite numbers >= 0")
    whole = float(sum(values))
    if whole <= 0:
        return [0] * len(values)
    exact = [100.0 * v / whole for v in values]
    points = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(values)), key=lambda i: (-(exact[i] - points[i]), i))
    for i in by_remainder[:100 - sum(points)]:
        points[i] += 1
    return points


def format_table(accounts: Sequence[GoodputAccount]) -> str:
    """A fixed-width table: one row per task (and a total row for several), seconds and shares
    of the span (:func:`shares`: they add up to 100 %).

    :param accounts: per-task accounts.
    :return: the table's lines joined by newlines (no trailing newline).
    """
    rows = list(accounts) + ([total(accounts)] if len(accounts) > 1 else [])
    head = f"{'task':>5} " + " ".join(f"{b:>12}" for b in BUCKETS) + f" {'span':>9} {'GPU-s':>9} {'goodput':>8}"
    lines = [head]
    for a in rows:
        name = "all" if a["task_index"] < 0 else str(a["task_index"])
        seconds = [a[b] for b in BUCKETS]  # type: ignore[literal-required]
        cells = " ".join(f"{s:7.1f} {p:3d}%" for s, p in zip(seconds, shares(seconds)))
        share = "-" if a["goodput"] is None else f"{100 * a['goodput']:.1f}%"
        lines.append(f"{name:>5} {cells} {a['span_seconds']:9.1f} {a['gpu_seconds']:9.1f} {share:>8}")
    return "\n".join(lines)


def describe(accounts: Sequence[GoodputAccount]) -> str:
    """One sentence for an error message or a log line: what the tasks' attempts cost and where it went.

    For a failed task, the figure its users look for: the GPU-seconds billed and how many of
    the span's seconds trained anything.

    :param accounts: per-task accounts (:func:`account_task`), possibly empty.
    :return: e.g. ``"Goodput account: 41.0 GPU-s billed over 3 attempt(s) of 1 task(s); productive
        0.0 s of a 45.2 s span (goodput 0.0 %); startup 38.0 s (1 attempt(s) without worker
        events), restore 0.0 s, save_stall 0.0 s, wasted 0.0 s (0 steps recomputed),
        recovery_gap 4.2 s."``; an account with no placed attempt says so.
    """
    whole = total(accounts)
    attempts = sum(len(a["attempts"]) for a in accounts)
    unknown = f", {whole['unknown_attempts']} more without known times" if whole["unknown_attempts"] else ""
    if attempts == 0:
        without = f" ({whole['unknown_attempts']} attempt(s) without times)" if whole["unknown_attempts"] else ""
        return f"Goodput account: no attempt with known times in {len(accounts)} task(s){without}."
    share = "-" if whole["goodput"] is None else f"{100 * whole['goodput']:.1f} %"
    notes = {"wasted": f" ({whole['steps_recomputed']} steps recomputed"
                       + (f", {whole['steps_uncommitted']} uncommitted" if whole["steps_uncommitted"] else "") + ")"}
    if whole["inferred_attempts"]:
        notes["startup"] = f" ({whole['inferred_attempts']} attempt(s) without worker events)"
    rest = ", ".join(f"{b} {whole[b]:.1f} s{notes.get(b, '')}" for b in BUCKETS[1:])  # type: ignore[literal-required]
    return (f"Goodput account: {whole['gpu_seconds']:.1f} GPU-s billed over {attempts} attempt(s) of "
            f"{len(accounts)} task(s){unknown}; productive {whole['productive']:.1f} s of a "
            f"{whole['span_seconds']:.1f} s span (goodput {share}); {rest}.")

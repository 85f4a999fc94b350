"""The goodput account on hand-made attempt histories (pure; about 0.1 s)."""

from __future__ import annotations

import re

import pytest

from airflow_gpu_resilience.goodput import BUCKETS, AttemptInput, account_task, describe, format_table, total

E = "job-abc"
CLEAN = {"process_start": 1.0, "restore_start": 2.0, "restore_end": 3.0, "first_step_at": 10.0,
         "save_blocking_seconds": 5.0, "steps": 900, "step_seconds": 0.09, "steps_recomputed": 0, "ended_at": 99.5}

CASES = {
    "one clean attempt": (
        [AttemptInput(E, 0, 0.0, 100.0, CLEAN)],
        dict(productive=85.0, startup=9.0, restore=1.0, save_stall=5.0, wasted=0.0, recovery_gap=0.0,
             span_seconds=100.0, gpu_seconds=100.0, unknown_attempts=0, steps_recomputed=0),
    ),
    "preempted, then resumed with 10 steps recomputed": (
        [AttemptInput(E, 0, None, None, {"process_start": 0.0, "first_step_at": 5.0, "save_blocking_seconds": 2.0,
                                          "steps": 90, "step_seconds": 0.5, "ended_at": 50.0}),
         AttemptInput(E, 1, 60.0, 120.0, {"restore_start": 62.0, "restore_end": 64.0, "first_step_at": 70.0,
                                           "steps": 100, "step_seconds": 0.5, "steps_recomputed": 10,
                                           "save_blocking_seconds": 1.0})],
        dict(productive=43.0 + 44.0, startup=5.0 + 8.0, restore=2.0, save_stall=3.0, wasted=5.0, recovery_gap=10.0,
             span_seconds=120.0, gpu_seconds=110.0, steps_recomputed=10),
    ),
    "never reached its first step": (
        [AttemptInput(E, 0, 0.0, 30.0, {"restore_start": 5.0, "restore_end": 8.0, "steps_recomputed": 4,
                                         "save_blocking_seconds": 1.0, "step_seconds": 0.5})],
        dict(productive=0.0, startup=27.0, restore=3.0, save_stall=0.0, wasted=0.0, span_seconds=30.0,
             steps_recomputed=0, gpu_seconds=30.0),
    ),
    "no events file: all start-up": (
        [AttemptInput(E, 0, 0.0, 12.0, None)],
        dict(startup=12.0, productive=0.0, span_seconds=12.0),
    ),
    "overlapping attempts are clipped, billed in full": (
        [AttemptInput(E, 1, 40.0, 100.0, {"first_step_at": 45.0}), AttemptInput(E, 0, 0.0, 50.0, {"first_step_at": 0.0})],
        dict(productive=50.0 + 50.0, startup=0.0, recovery_gap=0.0, span_seconds=100.0, gpu_seconds=110.0),
    ),
    "an attempt with no times is left out, its time is gap": (
        [AttemptInput(E, 0, 0.0, 10.0, None), AttemptInput(E, 1, None, None, None),
         AttemptInput("job-def", 0, 30.0, 40.0, None)],
        dict(startup=20.0, recovery_gap=20.0, span_seconds=40.0, unknown_attempts=1, gpu_seconds=20.0),
    ),
    "killed worker: its last write is the end": (
        [AttemptInput(E, 0, None, None, {"process_start": 100.0, "first_step_at": 104.0, "updated_at": 130.0})],
        dict(startup=4.0, productive=26.0, span_seconds=30.0),
    ),
    "events outside the attempt are clamped": (
        [AttemptInput(E, 0, 10.0, 20.0, {"restore_start": 0.0, "restore_end": 12.0, "first_step_at": 15.0,
                                          "save_blocking_seconds": 50.0, "steps_recomputed": 9, "steps": 9,
                                          "step_seconds": 1.0})],
        dict(restore=2.0, startup=3.0, save_stall=5.0, wasted=0.0, productive=0.0, span_seconds=10.0),
    ),
    "nothing at all": ([], dict(span_seconds=0.0, goodput=None, productive=0.0)),
    # a failed task's history is often partial: it must still be accounted, never raise
    "failed task: every attempt stopped before its first step, the last one still stopping": (
        [AttemptInput(E, 0, 0.0, 8.0, {"process_start": 0.5, "status": "failed", "ended_at": 7.9}),
         AttemptInput("job-def", 0, 12.0, 20.0, {"restore_start": 14.0, "restore_end": 15.0}),
         AttemptInput("job-ghi", 0, 25.0, None, {"process_start": 25.2, "updated_at": 31.0})],
        dict(productive=0.0, startup=8.0 + 7.0 + 6.0, restore=1.0, recovery_gap=4.0 + 5.0, span_seconds=31.0,
             gpu_seconds=8.0 + 8.0 + 6.0, goodput=0.0, unknown_attempts=0),
    ),
    # Cloud Run keeps the times of a task's latest attempt only: attempts stopped in their start-up,
    # before their worker wrote its events file, have no times of their own, yet they were billed
    "attempts without events or times are billed between the scheduled time and the next start": (
        [AttemptInput(E, 0, scheduled=0.0), AttemptInput(E, 1, scheduled=0.0), AttemptInput(E, 2, scheduled=0.0),
         AttemptInput(E, 3, 9.0, 20.0, {"first_step_at": 10.0}, scheduled=0.0)],
        dict(startup=9.0 + 1.0, productive=10.0, recovery_gap=0.0, span_seconds=20.0, gpu_seconds=20.0,
             unknown_attempts=0, inferred_attempts=3),
    ),
    "attempts without events between two timed ones share the time between them": (
        [AttemptInput(E, 0, None, None, {"process_start": 0.0, "first_step_at": 2.0, "ended_at": 10.0}),
         AttemptInput(E, 1), AttemptInput(E, 2),
         AttemptInput(E, 3, 16.0, 30.0, {"first_step_at": 17.0})],
        dict(startup=2.0 + 6.0 + 1.0, productive=8.0 + 13.0, recovery_gap=0.0, span_seconds=30.0, gpu_seconds=30.0,
             inferred_attempts=2),
    ),
    "a killed worker's attempt runs to the next start: the time after its last write is wasted": (
        [AttemptInput(E, 0, None, None, {"process_start": 0.0, "first_step_at": 2.0, "updated_at": 8.0}),
         AttemptInput(E, 1, 11.0, 20.0, {"first_step_at": 12.0})],
        dict(startup=2.0 + 1.0, productive=6.0 + 8.0, wasted=3.0, recovery_gap=0.0, span_seconds=20.0,
             gpu_seconds=20.0, inferred_attempts=0),
    ),
    "a worker that wrote its end proves the gap after it: not billed": (
        [AttemptInput(E, 0, None, None, {"process_start": 0.0, "first_step_at": 2.0, "ended_at": 8.0}),
         AttemptInput(E, 1, 11.0, 20.0, {"first_step_at": 12.0})],
        dict(wasted=0.0, recovery_gap=3.0, span_seconds=20.0, gpu_seconds=17.0),
    ),
    "ten preemptions, eight of them before the events file: every attempt billed": (
        [AttemptInput("job-a", n, scheduled=100.0) for n in range(8)]
        + [AttemptInput("job-a", 8, None, None, {"process_start": 140.0, "first_step_at": 143.0, "ended_at": 150.0},
                        scheduled=100.0),
           AttemptInput("job-a", 9, None, None, {"process_start": 150.5, "first_step_at": 153.0, "ended_at": 155.0},
                        scheduled=100.0),
           AttemptInput("job-a", 10, 155.2, 161.6, {"first_step_at": 157.0}, scheduled=100.0)],
        dict(startup=40.0 + 3.0 + 2.5 + 1.8, recovery_gap=0.5 + 0.2, span_seconds=61.6, gpu_seconds=60.9,
             inferred_attempts=8, unknown_attempts=0),
    ),
    "no scheduled time: attempts before the first timed one cannot be placed": (
        [AttemptInput(E, 0), AttemptInput(E, 1, 5.0, 9.0, None)],
        dict(startup=4.0, span_seconds=4.0, gpu_seconds=4.0, unknown_attempts=1, inferred_attempts=0),
    ),
    "garbage in the events file: wrong types, NaN, negatives, not a mapping": (
        [AttemptInput(E, 0, 0.0, 10.0, {"first_step_at": "2", "restore_start": float("nan"), "restore_end": 3.0,
                                         "save_blocking_seconds": float("inf"), "steps_recomputed": -4,
                                         "steps": -1, "step_seconds": True}),
         AttemptInput(E, 1, 20.0, 30.0, ["not", "a", "mapping"]),  # type: ignore[arg-type]
         AttemptInput(E, 2, float("nan"), None, {"first_step_at": 41.0, "ended_at": 45.0})],
        dict(startup=10.0 + 10.0, productive=0.0, save_stall=0.0, wasted=0.0, steps_recomputed=0, recovery_gap=10.0,
             span_seconds=30.0, unknown_attempts=1, gpu_seconds=20.0),
    ),
}


@pytest.mark.parametrize("attempts, expected", CASES.values(), ids=CASES.keys())
def test_account(attempts, expected):
    account = account_task(0, attempts, gpus_per_task=1)
    for key, value in expected.items():
        assert account[key] == pytest.approx(value), key
    assert sum(account[b] for b in BUCKETS) == pytest.approx(account["span_seconds"])
    assert account["attempt_seconds"] + account["recovery_gap"] == pytest.approx(account["span_seconds"])
    for row in account["attempts"]:
        parts = row["productive"] + row["startup"] + row["restore"] + row["save_stall"] + row["wasted"]
        assert parts == pytest.approx(row["wall_seconds"]) and min(parts, row["productive"]) >= 0


def test_total_table_and_bad_input():
    a = account_task(0, CASES["one clean attempt"][0], gpus_per_task=2)
    b = account_task(1, CASES["never reached its first step"][0])
    assert a["gpu_seconds"] == 200.0
    both = total([a, b])
    assert both["span_seconds"] == 130.0 and both["goodput"] == pytest.approx(85.0 / 130.0)
    table = format_table([a, b])
    assert table.splitlines()[0].split()[:7] == ["task", *BUCKETS] and table.splitlines()[-1].startswith("  all")
    with pytest.raises(ValueError, match="gpus_per_task"):
        account_task(0, [], gpus_per_task=-1)


#: (bucket seconds, the table's whole percentages): the shares shown add up to exactly 100 %
#: (largest remainder); rounding each share alone showed 99 % or 101 % for these.
SHARES = {
    "three equal thirds (each alone: 33 %)": ([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], [34, 33, 33, 0, 0, 0]),
    "six equal sixths (each alone: 17 %, 102 %)": ([1.0] * 6, [17, 17, 17, 17, 16, 16]),
    "a failed task's account (each alone: 8 + 59 + 4 + 0 + 28 + 0 = 99 %)": (
        [5.9, 44.6, 3.3, 0.2, 21.4, 0.3], [8, 59, 4, 0, 28, 1]),
    "one bucket": ([0.0, 12.5, 0.0, 0.0, 0.0, 0.0], [0, 100, 0, 0, 0, 0]),
    "nothing": ([0.0] * 6, [0] * 6),
}


@pytest.mark.parametrize("seconds, expected", SHARES.values(), ids=SHARES.keys())
def test_the_tables_shares_add_up_to_100(seconds, expected):
    account = account_task(0, [])
    account.update(dict(zip(BUCKETS, seconds)), span_seconds=sum(seconds))
    [_, row] = format_table([account]).splitlines()
    shown = [int(p) for p in re.findall(r"(?<![\d.])(\d+)%", row)]
    assert shown == expected
    assert sum(shown) == (100 if sum(seconds) else 0)


@pytest.mark.parametrize("seconds, expected", SHARES.values(), ids=SHARES.keys())
def test_shares(seconds, expected):
    from airflow_gpu_resilience.goodput import shares

    assert shares(seconds) == expected


@pytest.mark.parametrize("bad", [[-1.0, 2.0], [float("nan")], [float("inf"), 1.0], ["3"]])
def test_shares_refuse_what_is_not_an_amount(bad):
    from airflow_gpu_resilience.goodput import shares

    with pytest.raises(ValueError, match=r"^values=.* must all be finite numbers >= 0$"):
        shares(bad)


HEADLINES = {
    "the failed task of the table": (
        "failed task: every attempt stopped before its first step, the last one still stopping",
        "Goodput account: 22.0 GPU-s billed over 3 attempt(s) of 1 task(s); productive 0.0 s of a 31.0 s span "
        "(goodput 0.0 %); startup 21.0 s, restore 1.0 s, save_stall 0.0 s, wasted 0.0 s (0 steps recomputed), "
        "recovery_gap 9.0 s.",
    ),
    "a preempted and resumed task": (
        "preempted, then resumed with 10 steps recomputed",
        "Goodput account: 110.0 GPU-s billed over 2 attempt(s) of 1 task(s); productive 87.0 s of a 120.0 s span "
        "(goodput 72.5 %); startup 13.0 s, restore 2.0 s, save_stall 3.0 s, wasted 5.0 s (10 steps recomputed), "
        "recovery_gap 10.0 s.",
    ),
    "unknown times are counted": (
        "an attempt with no times is left out, its time is gap",
        "Goodput account: 20.0 GPU-s billed over 2 attempt(s) of 1 task(s), 1 more without known times; "
        "productive 0.0 s of a 40.0 s span (goodput 0.0 %); startup 20.0 s, restore 0.0 s, save_stall 0.0 s, "
        "wasted 0.0 s (0 steps recomputed), recovery_gap 20.0 s.",
    ),
    "nothing timed": ("nothing at all", "Goodput account: no attempt with known times in 1 task(s)."),
}


@pytest.mark.parametrize("case, expected", HEADLINES.values(), ids=HEADLINES.keys())
def test_headline(case, expected):
    """The one line a failure's message ends with (:func:`describe`)."""
    assert describe([account_task(0, CASES[case][0])]) == expected


def test_headline_of_several_tasks_and_of_none():
    a = account_task(0, CASES["one clean attempt"][0])
    b = account_task(1, [AttemptInput(E, 0, None, None, None)])
    assert describe([a, b]).startswith("Goodput account: 100.0 GPU-s billed over 1 attempt(s) of 2 task(s), "
                                       "1 more without known times; productive 85.0 s of a 100.0 s span")
    assert describe([b]) == "Goodput account: no attempt with known times in 1 task(s) (1 attempt(s) without times)."
    assert describe([]) == "Goodput account: no attempt with known times in 0 task(s)."


P = {"step_seconds": 0.5, "save_blocking_seconds": 0.0}
UNFINISHED = {
    # attempt 1 recomputed 10 steps (wasted) and added 10 that no checkpoint kept: none of its
    # training seconds, its steps' measured time or the rest, was productive
    "the last attempt's steps past the newest commit are wasted, once": (
        [AttemptInput(E, 0, 0.0, 50.0, {**P, "first_step_at": 5.0, "resumed_from_step": 0, "steps": 90}),
         AttemptInput(E, 1, 60.0, 100.0, {**P, "first_step_at": 70.0, "resumed_from_step": 80, "steps": 20,
                                           "steps_recomputed": 10})],
        90, dict(productive=45.0, wasted=5.0 + 25.0, steps_recomputed=10, steps_uncommitted=10),
    ),
    "the last attempt never trained: the one before kept the share of its steps committed": (
        [AttemptInput(E, 0, 0.0, 30.0, {**P, "first_step_at": 2.0, "resumed_from_step": 0, "steps": 40}),
         AttemptInput(E, 1, 40.0, 50.0, {"process_start": 40.0})],
        30, dict(productive=28.0 * 30 / 40, wasted=28.0 * 10 / 40, startup=2.0 + 10.0, steps_uncommitted=10),
    ),
    "no checkpoint ever committed: no productive second, whatever the step time says": (
        [AttemptInput(E, 0, 0.0, 30.0, {**P, "first_step_at": 2.0, "resumed_from_step": 0, "steps": 40})],
        0, dict(productive=0.0, wasted=28.0, steps_uncommitted=40, goodput=0.0),
    ),
    "no checkpoint, a killed worker's tail and an attempt without events: nothing productive, all billed": (
        [AttemptInput(E, 0, None, None, {**P, "process_start": 0.0, "first_step_at": 2.0, "resumed_from_step": 0,
                                          "steps": 10, "updated_at": 9.0}, scheduled=0.0),
         AttemptInput(E, 1, scheduled=0.0),
         AttemptInput(E, 2, 14.0, 20.0, {**P, "first_step_at": 15.0, "resumed_from_step": 0, "steps": 8,
                                          "steps_recomputed": 10}, scheduled=0.0)],
        0, dict(productive=0.0, startup=2.0 + 5.0 + 1.0, wasted=7.0 + 5.0, gpu_seconds=20.0, goodput=0.0,
                inferred_attempts=1),
    ),
    "everything committed: nothing moves": (
        [AttemptInput(E, 0, 0.0, 30.0, {**P, "first_step_at": 2.0, "resumed_from_step": 0, "steps": 40})],
        40, dict(productive=28.0, wasted=0.0, steps_uncommitted=0),
    ),
    "no checkpoint, preempted again before the step it lost: every step is wasted": (
        [AttemptInput(E, 0, 0.0, 12.0, {**P, "first_step_at": 2.0, "resumed_from_step": 0, "steps": 20}),
         AttemptInput(E, 1, 15.0, 22.0, {**P, "first_step_at": 17.0, "resumed_from_step": 0, "steps": 10,
                                          "steps_recomputed": 20}),
         AttemptInput(E, 2, 25.0, 30.0, {**P, "first_step_at": 27.0, "resumed_from_step": 0, "steps": 6,
                                          "steps_recomputed": 20})],
        0, dict(productive=0.0, wasted=10.0 + 5.0 + 3.0, steps_recomputed=40, steps_uncommitted=20),
    ),
    "no resumed step recorded, no checkpoint: still nothing kept": (
        [AttemptInput(E, 0, 0.0, 30.0, {**P, "first_step_at": 2.0, "steps": 40})],
        0, dict(productive=0.0, wasted=28.0, steps_uncommitted=40),
    ),
    "no resumed step recorded: at most the committed steps are kept": (
        [AttemptInput(E, 0, 0.0, 30.0, {**P, "first_step_at": 2.0, "steps": 40})],
        20, dict(productive=14.0, wasted=14.0, steps_uncommitted=20),
    ),
}


@pytest.mark.parametrize("attempts, durable, expected", UNFINISHED.values(), ids=UNFINISHED.keys())
def test_account_of_a_task_that_did_not_finish(attempts, durable, expected):
    """``durable_step`` (a failed task): work past the newest commit is wasted, not productive."""
    account = account_task(0, attempts, durable_step=durable)
    for key, value in expected.items():
        assert account[key] == pytest.approx(value), key
    assert sum(account[b] for b in BUCKETS) == pytest.approx(account["span_seconds"])
    assert account_task(0, attempts)["steps_uncommitted"] == 0  # a finished task: nothing moved


@pytest.mark.parametrize("durable", [-1, 1.5, True, "3"])
def test_durable_step_must_be_a_step(durable):
    with pytest.raises(ValueError, match=r"^durable_step=.* must be an integer >= 0 or None$"):
        account_task(0, [], durable_step=durable)

"""What ``bench_goodput.py`` makes of a run: from the worker's JSON logs, its goodput events
files, the emulator's API and its preemption schedule, the lineage of resumes and saves, the
work lost, the downtime and its parts, the durable step, one run's summary, the provider's
goodput account of it, and the targets' verdicts (see ``bench_goodput.py`` for the definitions).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import common

if TYPE_CHECKING:
    from bench_goodput import Lab

#: The strategies compared, in the order of the tables and the plot.
STRATEGIES = ("no-ckpt", "sync-every-N", "this-worker")

_COMMIT = re.compile(r"^ckpt-(\d+)\.commit\.json$")


def attempt_events(lab: Lab, executions: list) -> tuple:
    """:return: ``(((execution index, attempt), events) per attempt in order, attempts per
    execution)``; the events are the
    worker's JSON log lines (``{data_dir}/logs/{execution}/task0-attempt{n}.log``)."""
    per_attempt, counts = [], []
    for i, name in enumerate(executions):
        task = next(iter(lab.clients["tasks"].list_tasks(parent=name)))
        counts.append(task.retried + 1)
        folder = lab.emulator.data_dir / "logs" / name.rsplit("/", 1)[-1]
        logs = sorted(folder.glob("task0-attempt*.log"), key=lambda p: int(p.stem.rsplit("attempt", 1)[-1]))
        per_attempt += [((i, int(p.stem.rsplit("attempt", 1)[-1])), common.read_log_events(p)) for p in logs]
    return per_attempt, counts


def _is_step_event(message: str) -> bool:
    return message.startswith(("progress:", "exiting", "checkpoint saved")) or "received; stopping" in message


def lineage(per_attempt: list) -> dict:
    """Walk the attempts' logs: resumes, steps lost at each resume, saves, the auto interval.

    :param per_attempt: ``((execution index, attempt), events)`` of each attempt, in order.
    :return: ``{"resumes": [(epoch, step, lost_steps, key)], "high_water", "saves": [(seconds, mode)],
        "interval_s", "save_cost_s"}``.
    """
    high, resumes, saves, interval, cost = 0, [], [], None, None
    for key, events in per_attempt:
        for e in events:
            message = e.get("message", "")
            if message.startswith(("resuming from step", "no checkpoint found")):
                step = int(e["resumed_from_step"])
                resumes.append((e["t"], step, max(0, high - step), key))
                high = step
            elif _is_step_event(message) and isinstance(e.get("step"), int):
                high = max(high, e["step"])
            if message == "checkpoint saved":
                saves.append((float(e["seconds"]), e.get("mode")))
            if "interval_seconds" in e:
                interval, cost = float(e["interval_seconds"]), float(e.get("save_cost_seconds", 0.0))
    return {"resumes": resumes, "high_water": high, "saves": saves, "interval_s": interval, "save_cost_s": cost}


def downtime(resumes: list, preemptions: list, ended: float) -> float:
    """Seconds without training caused by preemptions, summed over outages.

    An outage starts at a preemption and ends at the first resume of a later attempt (the
    preempted attempt's own resume line, when the SIGTERM came during its start, does not end
    it), or at ``ended`` when no later attempt resumed.

    :param resumes: ``(epoch, (execution index, attempt))`` of each resume, in order.
    :param preemptions: ``(epoch, (execution index, attempt))`` of each preemption.
    """
    total, pending = 0.0, sorted(preemptions)
    for t, key in resumes:
        hits = [p for p in pending if p[1] < key and p[0] < t]
        if hits:
            total += t - min(p[0] for p in hits)
            pending = [p for p in pending if p not in hits]
    if pending:
        total += max(0.0, ended - min(p[0] for p in pending))
    return total


#: The parts of one preemption's downtime, in order (see :func:`downtime_parts`).
DOWNTIME_PARTS = ("stop", "restart", "startup", "restore")


def goodput_events(lab: Lab, job_id: str) -> dict:
    """:return: ``(execution short id, attempt)`` -> the worker's goodput events file of that attempt."""
    events = {}
    for path in sorted(lab.namespace(job_id).glob("goodput-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        events[(data.get("execution"), data.get("attempt"))] = data
    return events


def downtime_parts(events: dict, executions: list, counts: list, preempted: list) -> dict:
    """What one preemption's downtime is made of, from the worker's goodput events (mean seconds).

    For each preemption of an attempt A followed by an attempt B (the next one of the same
    execution, else the first of the next execution):

    - ``stop``: the preemption to A's exit (``ended_at``: the SIGTERM flush, the save in flight);
    - ``restart``: A's exit to B's process start (the platform seeing the exit, the retry, the
      container start);
    - ``startup``: B's process start to its checkpoint load (interpreter, ``import torch``, model
      and data set-up);
    - ``restore``: the checkpoint load itself.

    A pair where a time is missing (A killed without writing its end, B killed before it wrote
    its events file or its restore) is left out; ``n`` counts the pairs used, ``missing`` the
    preemptions left out.

    :param events: :func:`goodput_events`.
    :param executions: the run's execution names, in order.
    :param counts: attempts of each execution.
    :param preempted: ``(epoch, (execution index, attempt))`` of each preemption.
    :return: ``{"n", "missing", "stop", "restart", "startup", "restore"}`` (``None`` values when ``n`` is 0).
    """
    shorts = [name.rsplit("/", 1)[-1] for name in executions]
    sums, n = dict.fromkeys(DOWNTIME_PARTS, 0.0), 0
    for at, (index, attempt) in preempted:
        if not 0 <= index < len(shorts):
            continue
        nxt = (index, attempt + 1) if attempt + 1 < counts[index] else (index + 1, 0)
        if nxt[0] >= len(shorts):
            continue
        a, b = events.get((shorts[index], attempt)), events.get((shorts[nxt[0]], nxt[1]))
        if a is None or b is None:
            continue
        times = [at, a.get("ended_at"), b.get("process_start"), b.get("restore_start"), b.get("restore_end")]
        if any(not isinstance(t, (int, float)) for t in times) or not times[0] <= times[1]:
            continue
        for part, (t0, t1) in zip(DOWNTIME_PARTS, zip(times, times[1:])):
            sums[part] += t1 - t0
        n += 1
    return {"n": n, "missing": len(preempted) - n, **{part: (round(sums[part] / n, 3) if n else None) for part in DOWNTIME_PARTS}}


def durable_step(namespace: Path) -> int:
    """:return: the step of the newest commit record in ``namespace`` (0 when none)."""
    try:
        steps = [int(m.group(1)) for m in map(_COMMIT.match, (p.name for p in namespace.iterdir())) if m]
    except OSError:
        return 0
    return max(steps, default=0)


def summarize(lab: Lab, job_id: str, run: dict, schedule: dict, sched_start: float, args, t_step) -> dict:
    """:return: one run's measurements (see the module docstring for the definitions)."""
    per_attempt, counts = attempt_events(lab, run["executions"])
    walk = lineage(per_attempt)
    durable = args.steps if run["finished"] else durable_step(lab.namespace(job_id))
    lost_at_resumes = [lost for _t, _s, lost, _k in walk["resumes"]]
    lost_steps = sum(lost_at_resumes) + (0 if run["finished"] else max(0, walk["high_water"] - durable))
    events = schedule.get("preemptions", []) if schedule else []
    index = {name.rsplit("/", 1)[-1]: i for i, name in enumerate(run["executions"])}
    preempted = [(sched_start + e["atSeconds"], (index.get(e["task"].split("/executions/")[1].split("/")[0], -1),
                                                 int(e["attempt"]))) for e in events]
    wall = run["ended"] - run["started"]
    n = len(events)
    sync = [s for s, mode in walk["saves"] if mode == "sync"]
    result = {
        "strategy": lab.strategy, "job": job_id, "finished": run["finished"], "wall_s": round(wall, 2),
        "durable_steps": durable, "preemptions": n, "missed_preemptions": schedule.get("missed", 0) if schedule else 0,
        "executions": len(run["executions"]), "attempts": sum(counts), "lost_steps": lost_steps,
        "max_lost_steps_at_a_resume": max(lost_at_resumes, default=0),
        "downtime_s": round(downtime([(t, k) for t, _s, _l, k in walk["resumes"]], preempted, run["ended"]), 2),
        "checkpoints": len(walk["saves"]), "sync_save_median_s": _r(common.median(sync)),
        "interval_s": _r(walk["interval_s"]), "blocking_save_cost_s": _r(walk["save_cost_s"]),
    }
    result["account"] = goodput_account(lab, job_id, run["executions"], None if run["finished"] else durable)
    result["downtime_parts"] = downtime_parts(goodput_events(lab, job_id), run["executions"], counts, preempted)
    if t_step:
        result.update(useful_s=round(durable * t_step, 2), goodput=round(durable * t_step / wall, 4),
                      lost_s=round(lost_steps * t_step, 2),
                      lost_s_per_preemption=round(lost_steps * t_step / n, 3) if n else 0.0,
                      max_lost_s=round(result["max_lost_steps_at_a_resume"] * t_step, 3),
                      downtime_s_per_preemption=round(result["downtime_s"] / n, 2) if n else 0.0)
    return result


def goodput_account(lab: Lab, job_id: str, executions: list, durable: int | None = None) -> dict:
    """The provider's goodput account of task 0 over ``executions``, with ``recorded_seconds``.

    :param durable: for a run stopped before it finished (the benchmark's cap), the step of its
        newest committed checkpoint, as the execute operator passes it for a failed task: the last
        attempt's steps past it are wasted, not productive. ``None`` for a finished run.
    """
    from airflow_gpu_resilience.goodput import account_task
    from airflow_gpu_resilience.operators.goodput_report import attempt_inputs

    tasks = [(name, list(lab.clients["tasks"].list_tasks(parent=name))) for name in executions]
    account = account_task(0, attempt_inputs(tasks, {0: goodput_events(lab, job_id)}).get(0, []), durable_step=durable)
    recorded = sum(a["seconds"] for name in executions for a in lab.emulator.attempts(name))
    return {**{key: (round(value, 3) if isinstance(value, float) else value)
               for key, value in account.items() if key != "attempts"}, "recorded_seconds": round(recorded, 3)}


def _r(value, digits: int = 4):
    return None if value is None else round(value, digits)


def step_seconds(lab: Lab, run: dict) -> float:
    """``t_step`` of an uninterrupted run: ``no checkpoint found`` to ``training complete``."""
    events = [e for _key, events in attempt_events(lab, run["executions"])[0] for e in events]
    start = next(e["t"] for e in events if e.get("message", "").startswith("no checkpoint found"))
    end = next(e for e in events if e.get("message") == "training complete")
    return (end["t"] - start) / int(end["steps"])


def targets(runs: list, ceilings: dict, save_cost: float) -> dict:
    """Check the targets on this worker's preempted runs.

    - lost work per preemption at most one checkpoint interval (the restart is reported apart,
      as downtime): every run's largest loss at a resume <= its auto interval;
    - goodput >= 95 % where M is 20 times the save cost (the run(s) with M/C nearest to 20).
    """
    mine = [r for r in runs if r["strategy"] == "this-worker" and r["preemptions"]]
    lost_ok = all(r["max_lost_s"] <= (r["interval_s"] or 0.0) + 1e-9 for r in mine) if mine else None
    near = min((r["mtbi_over_save_cost"] for r in mine), key=lambda m: abs(m - 20), default=None)
    at20 = [r for r in mine if r["mtbi_over_save_cost"] == near]
    goodput = common.median(r["goodput"] for r in at20)
    down = common.median(r["downtime_s_per_preemption"] for r in mine)
    return {
        "extrapolation": {
            "note": "goodput ~ ceiling * (1 - (downtime + lost) / M); with no work lost, 95 % of the "
                    "uninterrupted goodput needs M >= 20 * downtime",
            "downtime_s_per_preemption_median": down, "M_for_95pct_of_ceiling_s": round(down / 0.05, 1) if down else None,
            "ceiling_uninterrupted": ceilings.get("this-worker")},
        "lost_work_within_one_interval": {
            "met": lost_ok, "max_lost_s": max((r["max_lost_s"] for r in mine), default=None),
            "intervals_s": sorted({r["interval_s"] for r in mine if r["interval_s"] is not None})},
        "goodput_95_at_M_20C": {
            "met": None if goodput is None else goodput >= 0.95, "M_over_C": near,
            "goodput": goodput, "ceiling_uninterrupted": ceilings.get("this-worker"),
            "downtime_s_per_preemption": common.median(r["downtime_s_per_preemption"] for r in at20)},
    }

"""Goodput under maintenance preemptions: no checkpointing vs the common recipe vs this worker.

The real worker (``python -m gpu_resilience_worker train`` through the image table ``worker/emulator-image.json``)
runs as a Cloud Run job in the local emulator, created and run with the ``google-cloud-run``
client (no Airflow). The emulator's seeded preemption schedule (``POST
/_emulator/preemptions/schedule``: exponential inter-arrival times with mean M, SIGTERM, grace,
SIGKILL) interrupts it; Cloud Run retries each preempted attempt (``maxRetries`` 10, preemptions
count as retries) and, when an execution runs out of retries, this script starts a new one (as
the execute operator does), from the same checkpoint namespace. Strategies, each in its own
emulator so that all three see the same preemption times (same seed), run concurrently:

- ``no-ckpt``: ``--checkpoint-every 0``: every preemption restarts from step 0.
- ``sync-every-N``: the common recipe: ``--checkpoint-every N --sync-save --preemption-save
  always`` (a synchronous save every N steps, a save on SIGTERM).
- ``this-worker``: ``--checkpoint-interval auto --mtbi M --async-save --preemption-save
  deadline`` (Young/Daly interval from the measured save cost, background saves, a flush at
  SIGTERM when it fits the grace period).

Definitions (all from the worker's own JSON logs, the emulator's API and its schedule):

- ``t_step``: seconds per step of the uninterrupted no-checkpoint run (calibration round):
  from its ``no checkpoint found`` line to its ``training complete`` line, over the steps.
- useful compute: steps in the final lineage (all steps when the run finished, else the step
  of the newest committed checkpoint: the durable work) times ``t_step``.
- wall time: from the first RunJob request to the last execution's completionTime.
- goodput = useful compute / wall time; ``ceiling``: the same strategy's uninterrupted goodput.
- work lost: for each resume, the highest step reached so far minus the step resumed from
  (plus, for an unfinished run, the steps past its last checkpoint), times ``t_step``.
- downtime: from a preemption to the next attempt's resume line (flush, exit, retry, process
  start, imports, checkpoint load), summed over outages.
- save cost ``C``: median synchronous save seconds of the calibration ``sync-every-N`` run.
- the goodput account (second table): the provider's own account of the run
  (:mod:`airflow_gpu_resilience.goodput`, as the execute operator builds it), from Cloud Run's
  task times and the worker's ``goodput-*.json`` files: seconds of productive training,
  start-up, restore, save stall, wasted (steps recomputed) and recovery gap; its goodput is
  productive over the span from the first attempt's start to the last one's end; ``GPU-s``, what it bills, beside
  ``recorded s``, the emulator's record; ``inferred`` / ``untimed``: attempts without times it placed / could not.
- the downtime's parts (third table, from the worker's ``goodput-*.json`` files): per
  preemption, ``stop`` (preemption to the preempted attempt's exit), ``restart`` (that exit to
  the next attempt's process start), ``startup`` (process start to checkpoint load) and
  ``restore`` (the load); see :func:`downtime_parts`.

Run::

    .venv/bin/python benchmarks/bench_goodput.py            # full run, about 5-6 minutes
    .venv/bin/python benchmarks/bench_goodput.py --quick    # smoke check, under a minute

Writes ``benchmarks/results/goodput.json`` and ``goodput.png`` (``--out`` to change).
Not a timed test: numbers depend on the machine and its load, which the output records.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

IMAGE = "us-central1-docker.pkg.dev/bench/ml/airflow-gpu-resilience-worker:bench"
BUCKET = "goodput-bench"
STRATEGIES = ("no-ckpt", "sync-every-N", "this-worker")
_COMMIT = re.compile(r"^ckpt-(\d+)\.commit\.json$")


def parse_args(argv=None) -> argparse.Namespace:
    """:return: the command-line options (``--quick`` replaces the sizes by small ones)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="optimizer steps of the job")
    p.add_argument("--hidden", type=int, default=4096, help="worker --hidden (state ~ 12*hidden^2 bytes)")
    p.add_argument("--batch-size", type=int, default=8, help="worker --batch-size")
    p.add_argument("--step-delay", type=float, default=0.2, help="worker --step-delay: emulated GPU step seconds")
    p.add_argument("--recipe-every", type=int, default=5, help="sync-every-N: steps between saves")
    p.add_argument("--multiples", type=float, nargs="+", default=[20, 40, 80],
                   help="mean times between preemptions M, as multiples of the measured save cost")
    p.add_argument("--mtbi", type=float, nargs="+", default=None, help="M values in seconds (overrides --multiples)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1], help="preemption schedule seeds")
    p.add_argument("--grace", type=float, default=10.0, help="SIGTERM-to-SIGKILL grace seconds")
    p.add_argument("--max-retries", type=int, default=10, help="Cloud Run maxRetries of the job")
    p.add_argument("--cap", type=float, default=1.8, help="stop a run after this many uninterrupted walls")
    p.add_argument("--quick", action="store_true", help="small sizes, one M, one seed: a smoke check")
    p.add_argument("--out", type=Path, default=common.RESULTS, help="results folder")
    p.add_argument("--workdir", type=Path, default=None, help="emulator state (default: a temp folder)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.hidden, args.step_delay, args.seeds = 20, 1024, 0.2, args.seeds[:1]
        args.mtbi, args.cap = args.mtbi or [20.0], 2.5
    return args


def worker_args(args, strategy: str, mtbi: float) -> list:
    """:return: the container args of ``strategy`` (the sizes are the same for all)."""
    base = ["train", f"--steps={args.steps}", f"--hidden={args.hidden}", f"--batch-size={args.batch_size}",
            f"--step-delay={args.step_delay}", "--threads=1", "--seed=0"]
    if strategy == "no-ckpt":
        return base + ["--checkpoint-every=0"]
    if strategy == "sync-every-N":
        return base + [f"--checkpoint-every={args.recipe_every}", "--sync-save", "--preemption-save=always"]
    return base + ["--checkpoint-interval=auto", f"--mtbi={mtbi:g}", "--async-save", "--preemption-save=deadline"]


class Lab:
    """One emulator (and its bucket, with the dataset) for one strategy.

    :param root: folder for the emulator's data.
    :param strategy: one of :data:`STRATEGIES`.
    :param grace: preemption grace seconds.
    """

    def __init__(self, root: Path, strategy: str, grace: float) -> None:
        from cloud_run_emulator.process import EmulatorProcess

        self.strategy = strategy
        self.emulator = EmulatorProcess(root / strategy, images_file=common.REPO / "worker" / "emulator-image.json",
                                        grace_seconds=grace)

    def __enter__(self) -> "Lab":
        self.emulator.__enter__()
        self.clients = common.run_clients(self.emulator.endpoint)
        bucket = common.storage_client(self.emulator.gcs_endpoint).create_bucket(BUCKET)
        bucket.blob("data/digits.npz").upload_from_string(common.digits_npz())
        return self

    def __exit__(self, *exc) -> None:
        self.emulator.stop()

    def create_job(self, job_id: str, args: list, max_retries: int) -> str:
        """Create the GPU job (GCS volume at /checkpoints); :return: its full name."""
        from airflow_gpu_resilience.job_spec import GpuJobSpec

        spec = GpuJobSpec(name=job_id, image=IMAGE, args=args, max_retries=max_retries, task_timeout=3600,
                          checkpoint_bucket=BUCKET)
        self.clients["jobs"].create_job(parent=common.PARENT, job=spec.to_job(), job_id=job_id).result(timeout=60)
        return f"{common.PARENT}/jobs/{job_id}"

    def namespace(self, job_id: str) -> Path:
        return self.emulator.bucket_dir(BUCKET) / job_id / "task-0"


def wait_execution(clients: dict, name: str, deadline: float, poll: float = 0.5):
    """Poll until the execution completes; :return: it, or ``None`` once ``deadline`` passed."""
    while True:
        execution = clients["executions"].get_execution(name=name)
        if execution.completion_time:
            return execution
        if time.time() >= deadline:
            return None
        time.sleep(poll)


def drive(lab: Lab, job: str, deadline_of) -> dict:
    """Run ``job`` until it succeeds, re-running executions that ran out of retries.

    :param deadline_of: callable returning the current deadline (epoch seconds); it may move.
    :return: ``{"started", "ended", "finished", "executions": [names]}``.
    """
    clients, names, started = lab.clients, [], time.time()
    while True:
        names.append(clients["jobs"].run_job(name=job).metadata.name)
        execution = wait_execution(clients, names[-1], deadline_of())
        if execution is None:  # out of time: cancel and wait for the stop
            clients["executions"].cancel_execution(name=names[-1])
            execution = wait_execution(clients, names[-1], time.time() + 60)
            return {"started": started, "ended": time.time(), "finished": False, "executions": names}
        if execution.succeeded_count == execution.task_count:
            return {"started": started, "ended": execution.completion_time.timestamp(), "finished": True,
                    "executions": names}
        if time.time() >= deadline_of():
            return {"started": started, "ended": execution.completion_time.timestamp(), "finished": False,
                    "executions": names}


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


class RoundClock:
    """Deadlines of the strategies of one round: each has a cap; once every other strategy has
    ended, a straggler gets at most until ``max(others' end, its own soft limit)``.

    :param caps: strategy -> (start epoch, cap seconds, soft limit seconds).
    """

    def __init__(self, caps: dict) -> None:
        self.caps, self.ended, self.lock = caps, {}, threading.Lock()

    def deadline(self, strategy: str) -> float:
        start, cap, soft = self.caps[strategy]
        with self.lock:
            others = [s for s in self.caps if s != strategy]
            if all(s in self.ended for s in others):
                return min(start + cap, max(max(self.ended[s] for s in others), start + soft))
        return start + cap

    def end(self, strategy: str) -> None:
        with self.lock:
            self.ended[strategy] = time.time()


SHORT = {"no-ckpt": "nockpt", "sync-every-N": "recipe", "this-worker": "worker"}


def run_round(labs: dict, args, tag: str, mtbi, seed, walls) -> dict:
    """Run every strategy's job at once, each under its own emulator's schedule (same seed).

    :param walls: strategy -> uninterrupted wall seconds (for the caps), or ``None`` (no cap).
    :return: strategy -> ``{"job_id", "run", "schedule", "sched_start"}``.
    """
    jobs = {s: (f"{SHORT[s]}-{tag}", lab.create_job(f"{SHORT[s]}-{tag}", worker_args(args, s, mtbi or 3600.0),
                                                    args.max_retries)) for s, lab in labs.items()}
    now = time.time()
    clock = RoundClock({s: (now, args.cap * walls[s] if walls else 900.0, 1.5 * walls[s] if walls else 900.0)
                        for s in labs})
    results, errors = {}, []

    def one(strategy: str) -> None:
        lab, (job_id, job) = labs[strategy], jobs[strategy]
        try:
            sched_start = None
            if mtbi:
                lab.emulator.schedule_preemptions(mtbi, seed=seed, name_prefix=job, grace_seconds=args.grace)
                sched_start = time.time()
            try:
                run = drive(lab, job, lambda: clock.deadline(strategy))
            finally:
                clock.end(strategy)
            schedule = lab.emulator.preemption_schedule(stop=True) if mtbi else None
            results[strategy] = {"job_id": job_id, "run": run, "schedule": schedule, "sched_start": sched_start}
        except Exception as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(s,), name=f"drive-{s}", daemon=True) for s in labs]
    for thread in threads:
        thread.start()
    common.join_all(threads)
    if errors:
        raise errors[0]
    return results


def measure(labs: dict, raw: dict, args, t_step: float, mtbi, seed, save_cost: float) -> list:
    """:return: one summary per strategy of a round, with M, M/C and the seed added."""
    rows = []
    for strategy, r in raw.items():
        row = summarize(labs[strategy], r["job_id"], r["run"], r["schedule"], r["sched_start"] or 0.0, args, t_step)
        row.update(mtbi_s=mtbi, mtbi_over_save_cost=round(mtbi / save_cost, 1) if mtbi and save_cost else None,
                   seed=seed)
        rows.append(row)
    return rows


def calibrate(labs: dict, args) -> tuple:
    """The uninterrupted round: :return: ``(t_step, save cost C, rows, walls)``."""
    raw = run_round(labs, args, "cal", None, None, None)
    t_step = step_seconds(labs["no-ckpt"], raw["no-ckpt"]["run"])
    cal = {s: summarize(labs[s], r["job_id"], r["run"], r["schedule"], 0.0, args, t_step) for s, r in raw.items()}
    sync = [s for s, mode in lineage(attempt_events(labs["sync-every-N"], raw["sync-every-N"]["run"]["executions"])[0])
            ["saves"] if mode == "sync"]
    save_cost = common.median(sync) or 0.0
    walls = {s: row["wall_s"] for s, row in cal.items()}
    rows = [dict(row, mtbi_s=None, mtbi_over_save_cost=None, seed=None) for row in cal.values()]
    return t_step, save_cost, rows, walls


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


HEADERS = ["M s", "M/C", "seed", "strategy", "done", "goodput", "of ceiling", "preempt", "exec", "attempts",
           "lost s/preempt", "max lost s", "down s/preempt", "ckpts", "interval s"]


def table_rows(rows: list) -> list:
    """:return: the printed cells of each run (``inf``: the uninterrupted calibration round)."""
    out = []
    for r in rows:
        out.append(["inf" if r["mtbi_s"] is None else f"{r['mtbi_s']:.1f}", r["mtbi_over_save_cost"] or "-",
                    r["seed"] if r["seed"] is not None else "-", r["strategy"], "yes" if r["finished"] else "NO",
                    f"{100 * r['goodput']:.1f}%", f"{100 * r['of_ceiling']:.0f}%" if r.get("of_ceiling") is not None else "-",
                    r["preemptions"], r["executions"], r["attempts"],
                    r["lost_s_per_preemption"], r["max_lost_s"], r["downtime_s_per_preemption"], r["checkpoints"],
                    r["interval_s"] if r["interval_s"] is not None else "-"])
    return out


ACCOUNT_HEADERS = ["M s", "seed", "strategy", "goodput (bench)", "goodput (account)", "productive s", "startup s",
                   "restore s", "save stall s", "wasted s", "recovery gap s", "span s", "GPU-s", "recorded s",
                   "steps redone", "inferred", "untimed"]


def account_rows(rows: list) -> list:
    """:return: the goodput account's cells of each run, beside the benchmark's own goodput."""
    out = []
    for r in rows:
        a = r.get("account") or {}
        share = a.get("goodput")
        out.append(["inf" if r["mtbi_s"] is None else f"{r['mtbi_s']:.1f}", r["seed"] if r["seed"] is not None else "-",
                    r["strategy"], f"{100 * r['goodput']:.1f}%", "-" if share is None else f"{100 * share:.1f}%",
                    *(a.get(k, "-") for k in ("productive", "startup", "restore", "save_stall", "wasted", "recovery_gap",
                                              "span_seconds", "gpu_seconds", "recorded_seconds", "steps_recomputed",
                                              "inferred_attempts", "unknown_attempts"))])
    return out


DOWNTIME_HEADERS = ["M s", "seed", "strategy", "down s/preempt", "pairs", "left out", "stop s", "restart s", "startup s",
                    "restore s", "sum s"]


def downtime_rows(rows: list) -> list:
    """:return: the downtime breakdown's cells of each preempted run (:func:`downtime_parts`)."""
    out = []
    for r in rows:
        parts = r.get("downtime_parts") or {}
        if not r["preemptions"]:
            continue
        known = [parts.get(p) for p in DOWNTIME_PARTS]
        out.append([f"{r['mtbi_s']:.1f}", r["seed"], r["strategy"], r["downtime_s_per_preemption"], parts.get("n", 0),
                    parts.get("missing", "-"),
                    *("-" if v is None else v for v in known),
                    "-" if None in known else round(sum(known), 3)])
    return out


def plot(path: Path, rows: list, ceilings: dict, save_cost: float) -> bool:
    """Goodput and lost work per preemption against M; :return: whether a PNG was written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for strategy, color in zip(STRATEGIES, ("tab:red", "tab:orange", "tab:green")):
        mine = sorted((r for r in rows if r["strategy"] == strategy and r["mtbi_s"]), key=lambda r: r["mtbi_s"])
        xs = [r["mtbi_s"] for r in mine]
        left.plot(xs, [100 * r["goodput"] for r in mine], "o-", color=color, label=strategy)
        left.axhline(100 * ceilings[strategy], color=color, linestyle=":", linewidth=1)
        right.plot(xs, [r["lost_s_per_preemption"] for r in mine], "o-", color=color, label=f"{strategy}: lost")
        right.plot(xs, [r["downtime_s_per_preemption"] for r in mine], "s--", color=color, label=f"{strategy}: down")
    if save_cost:
        left.axvline(20 * save_cost, color="grey", linestyle="--", linewidth=1, label="M = 20 C")
    left.axhline(95, color="black", linestyle="--", linewidth=0.8)
    left.set(xscale="log", xlabel="mean time between preemptions M (s)", ylabel="goodput (%)", ylim=(0, 100),
             title="Goodput (dotted: uninterrupted)")
    right.set(xscale="log", xlabel="mean time between preemptions M (s)", ylabel="seconds",
              title="Per preemption: work lost (solid), downtime (dashed)")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def start_labs(stack, workdir: Path, grace: float) -> dict:
    """Start one :class:`Lab` per strategy, in parallel; ``stack`` stops them. :return: them."""
    from concurrent.futures import ThreadPoolExecutor

    labs = {s: Lab(workdir, s, grace) for s in STRATEGIES}
    with ThreadPoolExecutor(len(labs)) as pool:
        futures = {s: pool.submit(lab.__enter__) for s, lab in labs.items()}
    for s, future in futures.items():
        if future.exception() is None:
            stack.callback(labs[s].__exit__, None, None, None)
    for future in futures.values():
        future.result()
    return labs


def run_all(args, workdir: Path) -> dict:
    """Start the labs, calibrate, run every (M, seed) round; :return: the JSON report."""
    import contextlib

    with contextlib.ExitStack() as stack:
        labs = start_labs(stack, workdir, args.grace)
        t_step, save_cost, cal_rows, walls = calibrate(labs, args)
        ceilings = {r["strategy"]: r["goodput"] for r in cal_rows}
        for row in cal_rows:
            row["of_ceiling"] = 1.0
        mtbis = args.mtbi or [round(m * save_cost, 1) for m in args.multiples]
        runs = []
        for i, mtbi in enumerate(mtbis):
            for seed in args.seeds:
                raw = run_round(labs, args, f"m{i}-s{seed}", mtbi, seed, walls)
                runs += measure(labs, raw, args, t_step, mtbi, seed, save_cost)
                for row in runs[-len(raw):]:
                    row["of_ceiling"] = round(row["goodput"] / ceilings[row["strategy"]], 4)
                print(f"[goodput] M={mtbi:g}s seed {seed}: " + ", ".join(
                    f"{r['strategy']} {100 * r['goodput']:.0f}%" for r in runs[-3:]), flush=True)
    state_mb = round(12 * args.hidden ** 2 / 1e6, 1)
    return {"t_step_s": round(t_step, 4), "save_cost_s": round(save_cost, 4), "state_mb_approx": state_mb,
            "mtbi_s": mtbis, "ceilings": ceilings, "calibration": cal_rows, "runs": runs,
            "targets": targets(runs, ceilings, save_cost)}


def report_lines(report: dict) -> list:
    """:return: the printed report (machine, settings, the table, the targets)."""
    cfg, t = report["config"], report["targets"]
    lost, good = t["lost_work_within_one_interval"], t["goodput_95_at_M_20C"]
    verdict = {True: "MET", False: "NOT MET", None: "not measured"}
    return common.machine_lines(report["machine"]) + [
        f"job: {cfg['steps']} steps, --hidden {cfg['hidden']} (state ~{report['state_mb_approx']} MB), "
        f"--batch-size {cfg['batch_size']}, --step-delay {cfg['step_delay']} s; grace {cfg['grace']} s, "
        f"maxRetries {cfg['max_retries']}; sync-every-N: N={cfg['recipe_every']}",
        f"t_step {report['t_step_s']} s; save cost C (sync save median) {report['save_cost_s']} s; "
        f"M values {report['mtbi_s']} s; seeds {cfg['seeds']}; elapsed {report['elapsed_s']} s",
        "", common.table(HEADERS, table_rows(report["calibration"] + report["runs"])), "",
        "goodput account (seconds; the provider's buckets from Cloud Run's task times and the worker's events):",
        common.table(ACCOUNT_HEADERS, account_rows(report["calibration"] + report["runs"])), "",
        "downtime per preemption, its parts (mean seconds over the preemptions whose times the worker recorded):",
        common.table(DOWNTIME_HEADERS, downtime_rows(report["runs"])), "",
        f"target: this worker's lost work per preemption <= one checkpoint interval: {verdict[lost['met']]} "
        f"(max lost {lost['max_lost_s']} s; intervals {lost['intervals_s']} s)",
        f"target: this worker's goodput >= 95% at M = 20 C: {verdict[good['met']]} (M/C {good['M_over_C']}: "
        f"goodput {good['goodput']}, uninterrupted ceiling {good['ceiling_uninterrupted']}, "
        f"downtime {good['downtime_s_per_preemption']} s per preemption)",
        f"extrapolation: 95% of the uninterrupted goodput ({t['extrapolation']['ceiling_uninterrupted']}) needs "
        f"M >= 20 x downtime = {t['extrapolation']['M_for_95pct_of_ceiling_s']} s (median downtime "
        f"{t['extrapolation']['downtime_s_per_preemption_median']} s per preemption)",
    ]


def main(argv=None) -> int:
    """Run the benchmark; print the table; write JSON and PNG. :return: 0."""
    args = parse_args(argv)
    common.apply_offline_env()
    common.stop_on_sigterm()
    machine, started = common.machine_info(), time.monotonic()
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="bench-goodput-"))).resolve()
    report = run_all(args, workdir)
    machine["load_at_end"] = common.load()
    config = {k: getattr(args, k) for k in ("steps", "hidden", "batch_size", "step_delay", "recipe_every",
                                            "multiples", "seeds", "grace", "max_retries", "cap", "quick")}
    report = {"benchmark": "goodput", "machine": machine, "config": config,
              "elapsed_s": round(time.monotonic() - started, 1), **report}
    lines = report_lines(report)
    print("\n".join(lines))
    report["table"] = lines
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_json(args.out / "goodput.json", report)
    drawn = plot(args.out / "goodput.png", report["runs"], report["ceilings"], report["save_cost_s"])
    print(f"[goodput] wrote {args.out / 'goodput.json'}" + (f" and {args.out / 'goodput.png'}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

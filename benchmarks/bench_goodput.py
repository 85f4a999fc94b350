"""Goodput under maintenance preemptions: no checkpointing vs the common recipe vs this worker.

The real worker (``python -m gpu_resilience_trainer train`` through the image table ``worker/emulator-image.json``)
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
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from goodput_analysis import STRATEGIES, attempt_events, lineage, step_seconds, summarize, targets  # noqa: E402
from goodput_report import plot, report_lines  # noqa: E402 - report_lines: the docs read it here

IMAGE = "us-central1-docker.pkg.dev/bench/ml/airflow-gpu-resilience-worker:bench"
BUCKET = "goodput-bench"


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

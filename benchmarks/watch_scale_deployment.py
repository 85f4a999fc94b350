"""The watch-scale benchmark's deployment mode: N deferred execute operators in a real Airflow
deployment, their triggers in its triggerer (``bench_watch_scale.py`` runs it, beside the
event-loop mode, and prints both in one table).

For each variant (``old``: the provider package of ``--old-ref`` from ``git archive``, first on
every Airflow process's ``PYTHONPATH``, so that the scheduler's task processes, the DAG
processor and the triggerer all run it; ``new``: this checkout's), one stack of
``scripts/airflow_stack.py`` (PostgreSQL, the scheduler with ``LocalExecutor``, the DAG
processor, the triggerer, the API server, the emulators) with ``benchmarks/dags/`` as its DAGs
folder, and in it, for each N in turn:

1. N jobs of one task each (``stack_sweep.ReleasableJobs``: the task runs until the benchmark
   releases it; ``max_retries`` 1) are created with the read quota off; then Cloud Run's read
   quota (``--read-quota``, 600 a minute per region) is on and the request counters zeroed;
2. one DAG run of ``watch_scale_n<N>`` (``benchmarks/dags/watch_scale_sweep.py``): N deferrable
   execute task instances, ``poll_interval`` ``--poll``;
3. once every task instance is deferred with its trigger in the triggerer and every execution's
   task runs, the executions are released one by one at seeded times spread over ``--spread``
   s, from ``--hold`` s on; a seeded ``--preempt-share`` of them is preempted once (1 s grace)
   before its release, and Cloud Run retries the task within its execution;
4. until the DAG run ends (or ``--run-timeout`` s after it was triggered).

Every 2 s the driver samples the triggerer's CPU seconds (its process group) and the region's
request counters. Measured per N:

- **reads/min, writes/min**: every Cloud Run request of the region (the triggerer's and the task
  instances' own: starting the execution, reading its result) from the first trigger's start to
  the last trigger's event (the trigger log files), per minute; **steady reads/min**: from one
  poll interval after every trigger runs to the first release, when only the triggerer reads;
  **429s** and **reads/exec** over the whole DAG run.
- **detect p50/p95**: an execution's ``completionTime`` to its trigger's event (the ``Trigger
  fired event`` line of the trigger's log); **task end p50/p95**: to the task instance's end.
- **undetected**: executions without a trigger event; **failed**: task instances not succeeded.
- **CPU s/exec-h**: the triggerer's CPU seconds in the window above, over the hours its
  triggers waited in all.
- **longest block**: the largest "Triggerer's async thread was blocked for X seconds" in the
  triggerer's log in that window, with ``[triggerer] blocked_main_thread_warning_threshold`` at
  ``--block-threshold`` (none: no block over it). Airflow's X counts its watchdog's 0.1 s sleep,
  so the block lay between X - 0.1 and X; Airflow exposes the same events, without their length,
  only as the statsd counter ``triggers.blocked_main_thread``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import common

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
#: An image of the bundled worker's table; each job's container command replaces its entrypoint.
IMAGE = "us-central1-docker.pkg.dev/local-project/ml/airflow-gpu-resilience-worker:latest"
SAMPLE_SECONDS = 2.0
TERMINAL = ("success", "failed")


def _modules():
    """``airflow_stack`` and ``stack_sweep`` (``scripts/``), and the sweep DAG's module."""
    for folder in (REPO / "scripts", HERE / "dags"):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    import airflow_stack
    import stack_sweep
    import watch_scale_sweep

    return airflow_stack, stack_sweep, watch_scale_sweep


def stack_config(src: Path | None, sizes: list, args: argparse.Namespace) -> dict:
    """Every Airflow process's settings: ``LocalExecutor`` with ``--parallelism`` task processes,
    no task retries (a failed try shows), the blocked-loop threshold, the sweep DAGs' sizes and
    poll interval, and for the old release its package first on ``PYTHONPATH``."""
    airflow_stack, _, _ = _modules()
    config = {**airflow_stack.FAST_HEARTBEATS,
              "AIRFLOW__CORE__PARALLELISM": str(args.parallelism),
              "AIRFLOW__CORE__DEFAULT_TASK_RETRIES": "0",
              "AIRFLOW__TRIGGERER__BLOCKED_MAIN_THREAD_WARNING_THRESHOLD": str(args.block_threshold),
              "WATCH_SCALE_SIZES": ",".join(str(n) for n in sizes), "WATCH_SCALE_POLL": str(args.poll)}
    if src is not None:
        config["PYTHONPATH"] = common.python_path(src)
    return config


def run_variant(variant: str, src: Path | None, sizes: list, args: argparse.Namespace, workdir: Path) -> list:
    """One stack for ``variant``, one sweep per N in ``sizes``; :return: the table rows."""
    airflow_stack, stack_sweep, _ = _modules()
    begin = time.monotonic()
    rows = []
    with airflow_stack.AirflowStack(workdir / f"deployment-{variant}", dags_folder=HERE / "dags", grace_seconds=1.0,
                                    airflow_config=stack_config(src, sizes, args),
                                    log=lambda line: print(f"[stack {variant}] {line}", flush=True)) as stack:
        stack_sweep.configure_emulator(stack.emulator, max(sizes) + 8, 0)
        for n in sizes:
            sweep = DeploymentSweep(stack, n, args, random.Random(args.seed * 100_003 + n))
            sweep.prepare()
            sweep.drive()
            rows.append(sweep.row(variant))
            rows[-1]["stack_start_s"] = stack.timings.get("total_s")
            print(f"[deployment {variant}] N={n}: {rows[-1]['run_s']} s from the trigger to the run's end",
                  flush=True)
    for row in rows:
        row["variant_wall_s"] = round(time.monotonic() - begin, 1)
    return rows


class DeploymentSweep:
    """One DAG run of N deferred execute tasks on a running stack, driven and measured (see the
    module docstring).

    :param stack: a started ``AirflowStack`` whose DAGs folder holds the sweep DAGs of ``n``.
    :param n: the number of executions; :param args: the benchmark's options.
    :param rng: the seeded generator of the release order, release times and preemptions.
    """

    def __init__(self, stack, n: int, args: argparse.Namespace, rng: random.Random) -> None:
        _, self.sweep, self.dags = _modules()
        self.stack, self.n, self.args = stack, n, args
        self.dag_id, self.run_id = self.dags.dag_id(n), f"watch-scale-n{n}"
        self.names = self.dags.job_names(n)
        self.jobs = self.sweep.ReleasableJobs(stack.emulator, self.dags.PROJECT, self.dags.REGION, self.names,
                                              stack.workdir / "release" / f"n{n}", check_seconds=2.0)
        self.api = stack.api_client()
        self.samples: list[tuple] = []  # (epoch s, triggerer CPU s, reads, writes, 429s)
        self.marks: dict[str, float] = {}
        self.timed_out = False
        self.plan = self._plan(rng)
        self.actions: list[tuple] = []
        self.preempted: list[str] = []

    def _plan(self, rng: random.Random) -> dict:
        """Seconds after every trigger runs: each job's release, and each preempted job's preemption."""
        order = rng.sample(self.names, len(self.names))
        release = {job: self.args.hold + rng.uniform(0, self.args.spread) for job in order}
        preempt = {job: rng.uniform(1.0, at - 3.0) for job, at in release.items()
                   if rng.random() < self.args.preempt_share and at - 3.0 > 1.0}
        return {"release": release, "preempt": preempt}

    def prepare(self) -> None:
        """The jobs created with the quota off; the DAG parsed and unpaused; the quota on, counters zeroed."""
        emulator = self.stack.emulator
        self.sweep.set_read_quota(emulator, 0)
        self.jobs.deploy(IMAGE, max_retries=1)
        self.sweep.unpause_when_parsed(self.api, self.dag_id)
        self.sweep.set_read_quota(emulator, self.args.read_quota)
        emulator.requests(reset=True)

    def sample(self) -> None:
        calls = common.api_calls(self.sweep.region_requests(self.stack.emulator, self.dags.PROJECT, self.dags.REGION))
        self.samples.append((time.time(), self.stack.procs["triggerer"].cpu_seconds(), calls["reads"],
                             calls["writes"], calls["quota_429"]))

    def _act(self) -> None:
        """Run the planned releases and preemptions that are due."""
        while self.actions and self.actions[0][0] <= time.time():
            _, kind, job = self.actions.pop(0)
            if kind == "release":
                self.jobs.release([job])
            else:
                try:
                    self.jobs.preempt(job, grace_seconds=1.0)
                    self.preempted.append(job)
                except (RuntimeError, OSError) as exc:  # its task was not running just then
                    print(f"[deployment] preempting {job}: {exc}", flush=True)

    def _wait(self, done, until: float) -> bool:
        """Sample, act and check ``done()`` every :data:`SAMPLE_SECONDS` until ``until`` (epoch s)."""
        while True:
            self.sample()
            self._act()
            if done():
                return True
            if time.time() > until:
                return False
            time.sleep(SAMPLE_SECONDS)

    def _all_watched(self) -> bool:
        """Every task instance deferred with its trigger in the triggerer (or ended), and every
        deferred one's execution task running."""
        import airflow_client.client as client

        try:
            tis = self.sweep.mapped_task_instances(self.api, self.dag_id, self.run_id, self.dags.TASK_ID)
        except client.ApiException:  # the scheduler has not expanded the mapped task yet
            return False
        states = [self.sweep.state(ti.state) for ti in tis]
        deferred = sum(s == "deferred" and ti.triggerer_job is not None for s, ti in zip(states, tis))
        if len(tis) < self.n or deferred + sum(s in TERMINAL for s in states) < self.n:
            return False
        return self.stack.emulator.task_processes()["running"] >= deferred

    def _run_state(self) -> str | None:
        import airflow_client.client as client

        return self.sweep.state(client.DagRunApi(self.api).get_dag_run(self.dag_id, self.run_id).state)

    def drive(self) -> None:
        """Trigger the DAG run; release and preempt by the plan once every trigger runs; wait for the end."""
        import airflow_client.client as client

        client.DagRunApi(self.api).trigger_dag_run(self.dag_id, client.TriggerDAGRunPostBody(
            dag_run_id=self.run_id, logical_date=None))
        self.marks["triggered"] = time.time()
        deadline = self.marks["triggered"] + self.args.run_timeout
        self.timed_out = not self._wait(self._all_watched, deadline)
        self.marks["all_watched"] = start = time.time()
        self.actions = sorted([(start + at, "release", job) for job, at in self.plan["release"].items()]
                              + [(start + at, "preempt", job) for job, at in self.plan["preempt"].items()])
        last_release = self.actions[-1][0]
        if not self._wait(lambda: self._run_state() in TERMINAL, max(deadline, last_release + 300)):
            self.timed_out = True
        self.marks["ended"] = time.time()
        self.jobs.release(self.names)  # nothing keeps running past the measurement

    def _at(self, t: float, column: int) -> float:
        """Sample ``column`` at epoch ``t``, interpolated linearly between the samples around it."""
        before = [s for s in self.samples if s[0] <= t] or self.samples[:1]
        after = [s for s in self.samples if s[0] >= t] or self.samples[-1:]
        a, b = before[-1], after[0]
        share = 0.0 if b[0] == a[0] else (t - a[0]) / (b[0] - a[0])
        return a[column] + share * (b[column] - a[column])

    def _outcome(self) -> dict:
        """What the run left: counters, end times, task instances, trigger times, blocked-loop warnings."""
        emulator = self.stack.emulator
        methods = self.sweep.region_requests(emulator, self.dags.PROJECT, self.dags.REGION)
        self.sweep.set_read_quota(emulator, 0)  # the benchmark's own reads below are not the deployment's
        logs = Path(self.stack.env["AIRFLOW_HOME"]) / "logs"
        listed = common.completion_times(emulator.endpoint, self.dags.PROJECT, self.dags.REGION)
        return {"methods": methods, "ends": {e["job"]: e["end"] for e in listed.values() if e["job"] in self.names},
                "tis": self.sweep.mapped_task_instances(self.api, self.dag_id, self.run_id, self.dags.TASK_ID),
                "triggers": self.sweep.trigger_times(logs, self.dag_id, self.run_id, self.dags.TASK_ID),
                "blocked": self.sweep.blocked_loop_warnings(self.stack.procs["triggerer"].log_path.read_text(
                    errors="replace"))}

    def row(self, variant: str) -> dict:
        """The table row of this run (see the module docstring for each figure)."""
        out = self._outcome()
        triggers, ends, state = out["triggers"], out["ends"], self.sweep.state
        fired = {i: t["fired"] for i, t in triggers.items() if t["fired"]}
        t0 = min((t["start"] for t in triggers.values() if t["start"]), default=self.marks["triggered"])
        t1 = max(fired.values(), default=self.marks["ended"])
        minutes = max(1e-9, t1 - t0) / 60
        steady0, steady1 = self.marks["all_watched"] + self.args.poll, self.marks["all_watched"] + self.args.hold
        steady = None if steady1 <= steady0 else \
            (self._at(steady1, 2) - self._at(steady0, 2)) * 60 / (steady1 - steady0)
        detect = [fired[i] - ends[job] for i, job in enumerate(self.names) if i in fired and job in ends]
        task_end = [ti.end_date.timestamp() - ends[self.names[ti.map_index]] for ti in out["tis"]
                    if ti.end_date and state(ti.state) == "success" and self.names[ti.map_index] in ends]
        hours = sum((fired.get(i) or t1) - t["start"] for i, t in triggers.items() if t["start"]) / 3600
        blocks = [seconds for at, seconds in out["blocked"] if at is not None and t0 - 1 <= at <= t1 + 1]
        calls = common.api_calls(out["methods"])
        return {
            "mode": "deployment", "variant": variant, "n": self.n, "preempted": len(self.preempted),
            "minutes": round(minutes, 2),
            "reads_per_min": round((self._at(t1, 2) - self._at(t0, 2)) / minutes, 1),
            "writes_per_min": round((self._at(t1, 3) - self._at(t0, 3)) / minutes, 1),
            "steady_reads_per_min": common.rounded(steady, 1),
            "reads_per_execution": round(calls["reads"] / self.n, 3), "quota_429": calls["quota_429"],
            "by_method": {name: m["requests"] for name, m in sorted(out["methods"].items())},
            **_quantiles("detection", detect), **_quantiles("task_end", task_end),
            "undetected": self.n - len(fired),
            "failed": sum(state(ti.state) != "success" for ti in out["tis"]) + self.n - len(out["tis"]),
            "cpu_s_per_execution_hour": common.rounded((self._at(t1, 1) - self._at(t0, 1)) / hours if hours else None),
            "longest_block_s": max(blocks, default=None), "blocked_warnings": len(blocks),
            "deferral_s": round(self.marks["all_watched"] - self.marks["triggered"], 1),
            "run_s": round(self.marks["ended"] - self.marks["triggered"], 1), "timed_out": self.timed_out,
        }


def _quantiles(name: str, values: list) -> dict:
    """``{name_p50_s, name_p95_s}`` of ``values`` (seconds), ``None`` when there are none."""
    return {f"{name}_p{q}_s": common.rounded(common.percentile(values, q / 100)) for q in (50, 95)}

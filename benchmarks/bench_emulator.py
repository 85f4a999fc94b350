"""Emulator scale benchmark: executions of 1, 100 and 1,000 short tasks.

For each size it creates a job of a short shell command (``echo``, then ``sleep`` 0.2 s), runs
it, and while it runs polls ``get_execution`` and ``list_tasks`` (first page, 100 tasks) from
two client threads, each call 20 ms after the previous answer. It reports the wall time from
``RunJob`` to the observed completion (and the ideal, ``ceil(tasks / parallelism) * 0.2 s``),
the task throughput, the most tasks seen running at once, and p50/p95/p99/max latency of both
calls; prints a table; writes
``benchmarks/results/emulator_scale.json`` and, when matplotlib is installed,
``benchmarks/results/emulator_scale.png``.

Run::

    .venv/bin/python benchmarks/bench_emulator.py [--sizes 1:1,100:10,1000:50] [--out DIR]

Defaults (``size:parallelism``) are 1:1, 100:10 and 1000:50; on a 2-core machine the whole run
takes well under a minute (emulator start included). Not a timed test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from google.auth.credentials import AnonymousCredentials
from google.cloud import run_v2

from cloud_run_emulator.process import EmulatorProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PARENT = "projects/bench-project/locations/us-central1"
IMAGE = "bench/short:latest"
SHORT_COMMAND = 'echo "task $CLOUD_RUN_TASK_INDEX attempt $CLOUD_RUN_TASK_ATTEMPT"; sleep "$TASK_SECONDS"'
RESULTS = Path(__file__).resolve().parent / "results"


def percentile(values: list, q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_ms(latencies: list) -> dict:
    """Count and p50/p95/p99/max of latencies given in seconds, in milliseconds."""
    ms = [s * 1000.0 for s in latencies]
    return {"count": len(ms), "p50": round(percentile(ms, 50), 2), "p95": round(percentile(ms, 95), 2),
            "p99": round(percentile(ms, 99), 2), "max": round(max(ms, default=0.0), 2),
            "mean": round(statistics.fmean(ms), 2) if ms else 0.0}


class Poller(threading.Thread):
    """Calls ``call()`` repeatedly until stopped, recording each call's latency (s).

    :param call: the API call to time.
    :param pause: seconds between calls.
    """

    def __init__(self, call, pause: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.call, self.pause = call, pause
        self.latencies: list = []
        self.answers: list = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            started = time.perf_counter()
            self.answers.append(self.call())
            self.latencies.append(time.perf_counter() - started)
            self.stopped.wait(self.pause)


def clients(endpoint: str) -> tuple:
    """Jobs, executions and tasks REST clients on the emulator."""
    opts = {"credentials": AnonymousCredentials(), "transport": "rest", "client_options": {"api_endpoint": endpoint}}
    return run_v2.JobsClient(**opts), run_v2.ExecutionsClient(**opts), run_v2.TasksClient(**opts)


def run_size(endpoint: str, task_count: int, parallelism: int, task_seconds: float) -> dict:
    """One execution of ``task_count`` short tasks; its wall time, counters and API latencies."""
    jobs, executions, tasks = clients(endpoint)
    job_id = f"bench-{task_count}-{int(time.time() * 1000) % 100000}"
    container = run_v2.Container(image=IMAGE, env=[run_v2.EnvVar(name="TASK_SECONDS", value=f"{task_seconds:g}")])
    template = run_v2.TaskTemplate(containers=[container], max_retries=0)
    spec = run_v2.Job(template=run_v2.ExecutionTemplate(task_count=task_count, parallelism=parallelism,
                                                        template=template))
    jobs.create_job(parent=PARENT, job=spec, job_id=job_id).result(timeout=30)
    started = time.perf_counter()
    name = jobs.run_job(name=f"{PARENT}/jobs/{job_id}").metadata.name
    polls = {"get_execution": Poller(lambda: executions.get_execution(name=name)),
             "list_tasks": Poller(lambda: tasks.list_tasks(
                 request=run_v2.ListTasksRequest(parent=name, page_size=100)))}
    for poller in polls.values():
        poller.start()
    while not (execution := executions.get_execution(name=name)).completion_time:
        time.sleep(0.01)
    wall = time.perf_counter() - started
    for poller in polls.values():
        poller.stopped.set()
        poller.join()
    peak = max((e.running_count for e in polls["get_execution"].answers), default=0)
    return {"tasks": task_count, "parallelism": parallelism, "task_seconds": task_seconds,
            "wall_seconds": round(wall, 3), "ideal_seconds": round(-(-task_count // parallelism) * task_seconds, 3),
            "tasks_per_second": round(task_count / wall, 1), "peak_running_seen": peak,
            "succeeded": execution.succeeded_count, "failed": execution.failed_count,
            "latency_ms": {call: summary_ms(p.latencies) for call, p in polls.items()}}


def write_images(directory: Path) -> Path:
    path = directory / "images.json"
    path.write_text(json.dumps({"images": {IMAGE: {"entrypoint": ["/bin/sh", "-c", SHORT_COMMAND]}}}))
    return path


def print_table(rows: list) -> None:
    head = (f"{'tasks':>6} {'par':>4} {'wall s':>7} {'ideal s':>7} {'tasks/s':>7} {'peak':>4} | "
            f"{'get_execution ms p50/p95/p99 (n)':>32} | {'list_tasks ms p50/p95/p99 (n)':>30}")
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = []
        for call in ("get_execution", "list_tasks"):
            s = r["latency_ms"][call]
            cells.append(f"{s['p50']:.1f}/{s['p95']:.1f}/{s['p99']:.1f} ({s['count']})")
        print(f"{r['tasks']:>6} {r['parallelism']:>4} {r['wall_seconds']:>7.2f} {r['ideal_seconds']:>7.2f} "
              f"{r['tasks_per_second']:>7.1f} {r['peak_running_seen']:>4} | {cells[0]:>32} | {cells[1]:>30}")


def plot(rows: list, path: Path) -> bool:
    """Latency percentiles and wall time per size as a PNG; ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = [r["tasks"] for r in rows]
    for call, marker in (("get_execution", "o"), ("list_tasks", "s")):
        for q, style in (("p50", "-"), ("p99", "--")):
            left.plot(sizes, [r["latency_ms"][call][q] for r in rows], style, marker=marker, label=f"{call} {q}")
    left.set(xscale="log", xlabel="tasks per execution", ylabel="latency (ms)", title="API latency while running")
    left.legend()
    right.bar([str(s) for s in sizes], [r["wall_seconds"] for r in rows])
    right.set(xlabel="tasks per execution", ylabel="wall time (s)", title="RunJob to completion")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def parse_sizes(text: str) -> list:
    """``"1:1,100:10"`` -> ``[(1, 1), (100, 10)]``."""
    return [tuple(int(x) for x in item.split(":")) for item in text.split(",") if item]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1:1,100:10,1000:50"),
                        help="comma-separated task_count:parallelism (default 1:1,100:10,1000:50)")
    parser.add_argument("--task-seconds", type=float, default=0.2, help="how long each task sleeps (default 0.2)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = common.machine_info()  # other work on the machine skews every number
    with tempfile.TemporaryDirectory(prefix="bench-emulator-") as tmp:
        with EmulatorProcess(Path(tmp) / "emu", images_file=write_images(Path(tmp)), grace_seconds=1.0,
                             max_task_processes=max(p for _, p in args.sizes)) as emu:  # parallelism is measured
            rows = [run_size(emu.endpoint, count, parallelism, args.task_seconds) for count, parallelism in args.sizes]
    machine.update(load_at_end=common.load(), system=platform.system(), cpus_usable=_cpus())
    print("\n".join(common.machine_lines(machine)) + "\n")
    print_table(rows)
    report = {"benchmark": "emulator_scale", "command": SHORT_COMMAND, "python": platform.python_version(),
              "machine": machine, "runs": rows}
    (args.out / "emulator_scale.json").write_text(json.dumps(report, indent=2) + "\n")
    png = args.out / "emulator_scale.png"
    print(f"wrote {args.out / 'emulator_scale.json'}" + (f" and {png}" if plot(rows, png) else
                                                        " (no plot: matplotlib is not installed)"))
    return 0 if all(r["succeeded"] == r["tasks"] for r in rows) else 1


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())

"""Cloud Run reads of N deferred executions: the per-execution polling trigger vs the shared watcher.

For each N (default 1, 10, 100 and 1,000) and each trigger (``old``: the trigger of the release
before the shared watcher, from ``git archive`` of ``--old-ref``; ``new``: this checkout's), a
fresh emulator runs N executions of one short task each (``sleep`` until a seeded end time, spread
over ``--spread`` seconds; a seeded ``--preempt-share`` of them preempted once and retried), with
Cloud Run's read quota of 600 per minute on. A child process (``--child``: only the trigger's
source tree on its path) imports the real trigger class on its event loop, as the triggerer
does, and runs N triggers in that one loop (``poll_interval`` ``--poll``) over gRPC
(``CLOUD_RUN_EMULATOR_HOST``), with a watchdog task measuring how late the loop wakes it.

Measured per run: API reads and writes per minute and the 429s (the emulator's request counters,
from the first trigger to the last event), detection delay (an execution's ``completionTime`` to
its trigger's event; p50, p95), CPU seconds of the triggers' process (from the trigger module's
import on) per execution-hour watched, the longest event-loop block, executions not detected by
the cap. Printed first: the import time of each trigger module over ``import airflow.triggers.base``.

Targets (the new watcher, N = 1,000): at most 300 reads a minute, detection p95 at most twice the
poll interval, reads per execution falling with N, the longest block under 0.1 s, and the
trigger's import under 0.2 s.

    .venv/bin/python benchmarks/bench_watch_scale.py                # all sizes, old and new
    .venv/bin/python benchmarks/bench_watch_scale.py --sizes 1,10 --spread 30 --variants new
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TRIGGER = "airflow_gpu_resilience.triggers.cloud_run"
IMAGE = "bench.local/sleep-until:latest"
#: Attempt 0 sleeps until the epoch second $1; a retry sleeps $2 seconds.
SLEEP_UNTIL = ('if [ "$CLOUD_RUN_TASK_ATTEMPT" != 0 ]; then exec sleep "$2"; fi; '
               'd=$(($1 - $(date +%s))); if [ "$d" -gt 0 ]; then exec sleep "$d"; fi')
PROJECT, REGION = "bench-project", "us-central1"


# --- the child: N triggers of one source tree in one event loop -----------------------------
def _admin(endpoint: str, method: str, path: str, body: dict | None = None) -> dict:
    """One admin request to the emulator (stdlib only: the child imports no emulator module)."""
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(endpoint + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


async def _watchdog(period: float, worst: list) -> None:
    """Sleep ``period`` again and again; keep the largest lateness (the longest loop block)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period
        await asyncio.sleep(period)
        worst[0] = max(worst[0], loop.time() - due)


async def _preempt(plan: dict, name: str, at: float) -> None:
    await asyncio.sleep(max(0.0, at - time.time()))
    try:
        await asyncio.to_thread(_admin, plan["endpoint"], "POST", "/_emulator/preempt",
                                {"execution": name, "taskIndex": 0, "graceSeconds": 1})
    except OSError:  # the task already ended: nothing to preempt
        pass


async def _child_main(plan_path: Path) -> None:
    plan = json.loads(plan_path.read_text())
    worst = [0.0]
    watchdog = asyncio.ensure_future(_watchdog(0.01, worst))
    await asyncio.sleep(0.05)
    import importlib

    cpu0, started_import = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    trigger_class = importlib.import_module(TRIGGER).CloudRunGpuExecutionTrigger  # on the loop, as the triggerer
    import_seconds, t0 = time.perf_counter() - started_import, time.time()
    events: dict[str, float] = {}

    async def one(name: str, index: int) -> None:
        trigger = trigger_class(execution=name, poll_interval=plan["poll"], carry={"bench": index})
        event = await anext(trigger.run())
        events[name] = time.time()
        assert event.payload["status"] in ("succeeded", "failed"), event.payload

    waits = [asyncio.ensure_future(one(name, i)) for i, name in enumerate(plan["executions"])]
    preempts = [asyncio.ensure_future(_preempt(plan, name, at)) for name, at in plan["preempt_at"].items()]
    await asyncio.wait(waits, timeout=max(1.0, plan["deadline"] - time.time()))
    t1, cpu1 = time.time(), resource.getrusage(resource.RUSAGE_SELF)
    for task in [*waits, *preempts, watchdog]:
        task.cancel()
    errors = [repr(w.exception()) for w in waits if w.done() and not w.cancelled() and w.exception()]
    watched = sum(events.get(name, t1) - t0 for name in plan["executions"])
    result = {"import_seconds_on_loop": round(import_seconds, 3), "start": t0, "end": max(events.values(), default=t1),
              "events": events, "errors": errors[:5], "cpu_seconds": (cpu1.ru_utime + cpu1.ru_stime)
              - (cpu0.ru_utime + cpu0.ru_stime), "watched_seconds": watched, "longest_block_s": round(worst[0], 4)}
    plan_path.with_suffix(".result.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # at once: threads of the old trigger may be sleeping in a retry, which asyncio.run would wait for


def child(plan_path: Path) -> None:
    """Run the plan's triggers and write the result beside the plan (``plan.result.json``).
    Airflow is imported first, as in a triggerer; the trigger's module on the loop."""
    import airflow.triggers.base  # noqa: F401

    asyncio.run(_child_main(plan_path))


# --- the parent: emulator, executions, counters ----------------------------------------------
def import_seconds(src: Path | None) -> float:
    """Seconds to import the trigger module after ``airflow.triggers.base`` (median of 3 fresh processes)."""
    code = ("import time, airflow.triggers.base; t = time.perf_counter(); import " + TRIGGER +
            "; print(time.perf_counter() - t)")
    times = sorted(float(subprocess.run([sys.executable, "-c", code], env=_env(src, {}), capture_output=True,
                                        text=True, check=True, cwd=tempfile.gettempdir()).stdout) for _ in range(3))
    return round(times[1], 3)


def _env(src: Path | None, extra: dict) -> dict:
    from cloud_run_emulator.process import OFFLINE_ENV

    env = {**os.environ, **OFFLINE_ENV, "AIRFLOW__CORE__LOAD_EXAMPLES": "False", **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src) if src else "", env.get("PYTHONPATH", "")) if p)
    return env


def old_source(ref: str, workdir: Path) -> Path:
    """The trigger's package as of ``ref`` (``git archive``), in ``workdir/old-src``."""
    if ref == "auto":  # the parent of the commit that added the shared watcher
        added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--",
                                "airflow_gpu_resilience/triggers/execution_watcher.py"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.split()
        ref = added[-1] + "^"
    target = workdir / "old-src"
    target.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", ref, "airflow_gpu_resilience"], cwd=REPO, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def start_executions(emu, n: int, args: argparse.Namespace, rng: random.Random) -> tuple[list, dict, float]:
    """One job, N executions ending at seeded times; return the names, the preemption times and the last end."""
    from google.cloud import run_v2

    import common

    clients = common.run_clients(emu.endpoint)
    parent = f"projects/{PROJECT}/locations/{REGION}"
    job = run_v2.Job(template=run_v2.ExecutionTemplate(task_count=1, template=run_v2.TaskTemplate(
        containers=[run_v2.Container(image=IMAGE)], max_retries=1)))
    clients["jobs"].create_job(parent=parent, job=job, job_id="bench-watch").result(timeout=60)
    first_end = time.time() + 15 + 0.03 * n + args.end_after  # after every RunJob and the child's start
    ends = sorted(first_end + rng.uniform(0, args.spread) for _ in range(n))
    names, preempt_at = [], {}
    for end in ends:
        overrides = {"container_overrides": [{"args": [str(int(end)), str(args.retry_seconds)]}]}
        names.append(clients["jobs"].run_job(request={"name": f"{parent}/jobs/bench-watch",
                                                      "overrides": overrides}).metadata.name)
        if rng.random() < args.preempt_share:
            preempt_at[names[-1]] = rng.uniform(first_end - args.end_after + 5, end - 5)
    return names, preempt_at, ends[-1]


def completion_times(emu, names: list) -> dict:
    """Each execution's ``completionTime`` (epoch seconds), read with the quota off."""
    import common

    executions = common.run_clients(emu.endpoint)["executions"]
    wanted = set(names)
    return {e.name: e.completion_time.timestamp() for e in executions.list_executions(
        parent=f"projects/{PROJECT}/locations/{REGION}/jobs/-") if e.name in wanted and e.completion_time}


def percentile(values: list, q: float) -> float | None:
    """The ``q`` quantile (0..1) by nearest rank, ``None`` when empty."""
    ordered = sorted(values)
    return None if not ordered else ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def run_cell(variant: str, src: Path | None, n: int, args: argparse.Namespace, workdir: Path) -> dict:
    """One emulator, N executions, one child with N triggers of ``variant``; the row of the table."""
    from cloud_run_emulator.process import EmulatorProcess

    cell = workdir / f"{variant}-{n}"
    images = cell / "images.json"
    cell.mkdir(parents=True, exist_ok=True)
    images.write_text(json.dumps({"images": {IMAGE: {"entrypoint": ["/bin/sh", "-c", SLEEP_UNTIL, "sh"]}}}))
    rng = random.Random(args.seed * 100_003 + n)
    with EmulatorProcess(cell / "emulator", images_file=images, grace_seconds=1.0, max_task_processes=n + 8) as emu:
        names, preempt_at, last_end = start_executions(emu, n, args, rng)
        deadline = last_end + args.retry_seconds + args.cap_after
        plan = {"endpoint": emu.endpoint, "poll": args.poll, "executions": names, "preempt_at": preempt_at,
                "deadline": deadline}
        (cell / "plan.json").write_text(json.dumps(plan))
        _admin(emu.endpoint, "POST", "/_emulator/quota", {"readRequestsPerMinute": args.read_quota,
                                                          "windowSeconds": 60})
        _admin(emu.endpoint, "DELETE", "/_emulator/requests")
        conn = {"conn_type": "google_cloud_platform", "extra": {"is_anonymous": True, "project": PROJECT}}
        env = _env(src, {"CLOUD_RUN_EMULATOR_HOST": emu.grpc_endpoint,
                         "AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT": json.dumps(conn)})
        with open(cell / "child.log", "wb") as log:
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(cell / "plan.json")],
                           env=env, cwd=tempfile.gettempdir(), check=True, timeout=deadline - time.time() + 300,
                           stdout=log, stderr=subprocess.STDOUT)
        counters = _admin(emu.endpoint, "GET", f"/_emulator/requests?project={PROJECT}&region={REGION}")
        _admin(emu.endpoint, "POST", "/_emulator/quota", {"readRequestsPerMinute": 0})
        ends = completion_times(emu, names)
    return row(variant, n, json.loads((cell / "plan.result.json").read_text()), counters, ends, len(preempt_at))


def row(variant: str, n: int, result: dict, counters: dict, ends: dict, preempted: int) -> dict:
    """The table row of one run from the child's result, the request counters and the end times."""
    minutes = max(1e-9, result["end"] - result["start"]) / 60
    writes = ("CreateJob", "UpdateJob", "DeleteJob", "RunJob", "DeleteExecution", "CancelExecution")
    methods = counters.get("methods", {})
    read_calls = sum(m["requests"] for name, m in methods.items() if name not in writes)
    write_calls = sum(m["requests"] for name, m in methods.items() if name in writes)
    delays = [result["events"][name] - end for name, end in ends.items() if name in result["events"]]
    hours = result["watched_seconds"] / 3600
    return {
        "variant": variant, "n": n, "preempted": preempted, "minutes": round(minutes, 2),
        "reads_per_min": round(read_calls / minutes, 1), "writes_per_min": round(write_calls / minutes, 1),
        "reads_per_execution": round(read_calls / n, 3),
        "quota_429": sum(m["quotaExceeded"] for m in methods.values()),
        "by_method": {name: m["requests"] for name, m in sorted(methods.items())},
        "detection_p50_s": _r(percentile(delays, 0.5)), "detection_p95_s": _r(percentile(delays, 0.95)),
        "undetected": n - len(result["events"]),
        "cpu_s_per_execution_hour": _r(result["cpu_seconds"] / hours if hours else None),
        "longest_block_s": result["longest_block_s"], "import_on_loop_s": result["import_seconds_on_loop"],
        "errors": result["errors"],
    }


def _r(value, digits: int = 2):
    return None if value is None else round(value, digits)


HEADERS = ["trigger", "N", "preempted", "reads/min", "writes/min", "reads/exec", "429s", "detect p50 s",
           "detect p95 s", "undetected", "CPU s/exec-h", "longest block s", "import on loop s"]


def table_rows(rows: list) -> list:
    return [[r["variant"], r["n"], r["preempted"], r["reads_per_min"], r["writes_per_min"], r["reads_per_execution"],
             r["quota_429"], r["detection_p50_s"], r["detection_p95_s"], r["undetected"],
             r["cpu_s_per_execution_hour"], r["longest_block_s"], r["import_on_loop_s"]] for r in rows]


def targets(rows: list, poll: float, imports: dict) -> dict:
    """The issue's targets, checked on the new watcher."""
    new = {r["n"]: r for r in rows if r["variant"] == "new"}
    big = new.get(max(new, default=0))
    per_exec = [new[n]["reads_per_execution"] for n in sorted(new)]
    return {
        "reads_per_min_at_largest_n_le_300": bool(big) and big["reads_per_min"] <= 300,
        "detection_p95_le_2x_poll": all(r["detection_p95_s"] is not None and r["detection_p95_s"] <= 2 * poll
                                        for r in new.values()),
        "reads_per_execution_falling_with_n": all(a > b for a, b in zip(per_exec, per_exec[1:])),
        "longest_block_lt_0_1_s": all(r["longest_block_s"] < 0.1 for r in new.values()),
        "trigger_import_lt_0_2_s": imports.get("new", 1.0) < 0.2,
    }


def plot(path: Path, rows: list) -> bool:
    """Reads per minute and detection p95 against N, old and new; :return: whether drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for variant, colour in (("old", "tab:red"), ("new", "tab:green")):
        mine = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["n"])
        axes[0].plot([r["n"] for r in mine], [r["reads_per_min"] for r in mine], "o-", color=colour, label=variant)
        axes[1].plot([r["n"] for r in mine], [r["detection_p95_s"] or 0 for r in mine], "o-", color=colour,
                     label=variant)
    axes[0].axhline(600, color="black", linestyle="--", linewidth=0.8, label="read quota")
    for ax, title in zip(axes, ("Cloud Run reads per minute", "detection delay p95 (s)")):
        ax.set_xscale("log")
        ax.set_xlabel("concurrent executions watched")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,10,100,1000", help="N values, comma-separated (default 1,10,100,1000)")
    parser.add_argument("--variants", nargs="+", default=["old", "new"], choices=["old", "new"])
    parser.add_argument("--old-ref", default="auto", help="git ref of the old trigger (default: the parent of the "
                        "commit that added triggers/execution_watcher.py)")
    parser.add_argument("--poll", type=float, default=10.0, help="the triggers' poll_interval, s (default 10)")
    parser.add_argument("--end-after", type=float, default=30.0, help="s from the triggers' start to the first end")
    parser.add_argument("--spread", type=float, default=90.0, help="s over which the executions end (default 90)")
    parser.add_argument("--preempt-share", type=float, default=0.1, help="share preempted once (default 0.1)")
    parser.add_argument("--retry-seconds", type=int, default=5, help="a retried attempt's sleep, s (default 5)")
    parser.add_argument("--cap-after", type=float, default=90.0, help="s after the last end before giving up")
    parser.add_argument("--read-quota", type=int, default=600, help="reads per minute per region (default 600)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Run every (N, trigger) cell; print the table; write JSON (and PNG). :return: 0."""
    args = parse_args(argv)
    if args.child:
        child(args.child)
    sys.path.insert(0, str(HERE))
    import common

    common.apply_offline_env()
    common.stop_on_sigterm()
    os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="bench-watch-airflow-"))
    machine, started = common.machine_info(), time.monotonic()
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="bench-watch-"))).resolve()
    sources = {"new": None, "old": old_source(args.old_ref, workdir) if "old" in args.variants else None}
    imports = {variant: import_seconds(sources[variant]) for variant in args.variants}
    print("trigger module import over `import airflow.triggers.base` (s): "
          + ", ".join(f"{v} {s}" for v, s in imports.items()), flush=True)
    rows = []
    for n in (int(size) for size in args.sizes.split(",")):
        for variant in args.variants:
            rows.append(run_cell(variant, sources[variant], n, args, workdir))
            print(common.table(HEADERS, table_rows(rows[-1:])).splitlines()[-1], flush=True)
    machine["load_at_end"] = common.load()
    report = {"benchmark": "watch_scale", "machine": machine, "elapsed_s": round(time.monotonic() - started, 1),
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "workdir", "child")},
              "watched_by": "the real CloudRunGpuExecutionTrigger class of each source tree, N of them in one "
                            "event loop of one process, over gRPC to the emulator",
              "import_seconds": imports, "rows": rows, "targets": targets(rows, args.poll, imports),
              "workdir": str(workdir)}
    lines = [*common.machine_lines(machine), f"watched by: {report['watched_by']}; poll_interval {args.poll} s; "
             f"read quota {args.read_quota}/min", f"trigger import (s): {imports}",
             common.table(HEADERS, table_rows(rows)), f"targets (new watcher): {report['targets']}"]
    print("\n".join(lines))
    report["table"] = lines
    common.write_json(args.out / "watch_scale.json", report)
    drawn = plot(args.out / "watch_scale.png", rows)
    print(f"[watch_scale] wrote {args.out / 'watch_scale.json'}" + (" and watch_scale.png" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

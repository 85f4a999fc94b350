"""The watch-scale benchmark's event-loop mode: N real triggers in one event loop of one process,
as a triggerer runs them (``bench_watch_scale.py`` runs it, beside the deployment mode, and
prints both in one table).

For each N and trigger (``old``: the trigger of the release before the shared watcher, from
``git archive`` of ``--old-ref``; ``new``: this checkout's), a fresh emulator runs N executions
of one short task each (``sleep`` until a seeded end time, spread over ``--spread`` seconds; a
seeded ``--preempt-share`` of them preempted once and retried), with Cloud Run's read quota of
600 per minute on. A child process (this module run as a script: only the trigger's source tree
on its path) imports the real trigger class on its event loop, as the triggerer does, and runs
N triggers in that one loop (``poll_interval`` ``--poll``) over gRPC
(``CLOUD_RUN_EMULATOR_HOST``), with a watchdog task measuring how late the loop wakes it.

Measured per run: API reads and writes per minute and the 429s (the emulator's request counters,
from the first trigger to the last event), detection delay (an execution's ``completionTime`` to
its trigger's event; p50, p95), CPU seconds of the triggers' process (from the trigger module's
import on) per execution-hour watched, the longest event-loop block (and the most of one block
that the loop thread's own CPU time explains, apart from waits for the processor), executions not
detected by the cap.
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
    """Sleep ``period`` again and again; keep in ``worst[0]`` the largest lateness (the longest
    loop block), in ``worst[1]`` the largest share of a lateness that the loop's own work can
    explain: the CPU seconds its thread used from one sleep's start to its wake-up, at most that
    lateness (the rest is time the thread waited to run: for the machine's other processes, or for
    this process's other threads, which hold the interpreter lock)."""
    loop = asyncio.get_running_loop()
    while True:
        due, cpu = loop.time() + period, time.thread_time()
        await asyncio.sleep(period)
        late = loop.time() - due
        worst[0] = max(worst[0], late)
        worst[1] = max(worst[1], min(late, time.thread_time() - cpu))


async def _preempt(plan: dict, name: str, at: float) -> None:
    await asyncio.sleep(max(0.0, at - time.time()))
    try:
        await asyncio.to_thread(_admin, plan["endpoint"], "POST", "/_emulator/preempt",
                                {"execution": name, "taskIndex": 0, "graceSeconds": 1})
    except OSError:  # the task already ended: nothing to preempt
        pass


async def _child_main(plan_path: Path) -> None:
    plan = json.loads(plan_path.read_text())
    worst = [0.0, 0.0]
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
              - (cpu0.ru_utime + cpu0.ru_stime), "watched_seconds": watched, "longest_block_s": round(worst[0], 4),
              "longest_block_cpu_s": round(worst[1], 4)}
    plan_path.with_suffix(".result.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # at once: threads of the old trigger may be sleeping in a retry, which asyncio.run would wait for


def child(plan_path: Path) -> None:
    """Run the plan's triggers and write the result beside the plan (``plan.result.json``); the
    parent runs this module as a script with the plan's path.
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
    """The child's environment: offline google-auth, ``src`` (a source tree) first on its path."""
    import common

    return {**os.environ, **common.OFFLINE_ENV, "AIRFLOW__CORE__LOAD_EXAMPLES": "False", **extra,
            "PYTHONPATH": common.python_path(src)}


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


def run_cell(variant: str, src: Path | None, n: int, args: argparse.Namespace, workdir: Path) -> dict:
    """One emulator, N executions, one child with N triggers of ``variant``; the row of the table."""
    from cloud_run_emulator.process import EmulatorProcess

    import common

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
            subprocess.run([sys.executable, str(Path(__file__).resolve()), str(cell / "plan.json")],
                           env=env, cwd=tempfile.gettempdir(), check=True, timeout=deadline - time.time() + 300,
                           stdout=log, stderr=subprocess.STDOUT)
        counters = _admin(emu.endpoint, "GET", f"/_emulator/requests?project={PROJECT}&region={REGION}")
        _admin(emu.endpoint, "POST", "/_emulator/quota", {"readRequestsPerMinute": 0})
        ends = {name: e["end"] for name, e in common.completion_times(emu.endpoint, PROJECT, REGION).items()}
    return row(variant, n, json.loads((cell / "plan.result.json").read_text()), counters, ends, len(preempt_at))


def row(variant: str, n: int, result: dict, counters: dict, ends: dict, preempted: int) -> dict:
    """The table row of one run from the child's result, the request counters and the end times."""
    import common

    minutes = max(1e-9, result["end"] - result["start"]) / 60
    methods = counters.get("methods", {})
    calls = common.api_calls(methods)
    delays = [result["events"][name] - end for name, end in ends.items() if name in result["events"]]
    hours = result["watched_seconds"] / 3600
    return {
        "mode": "event loop", "variant": variant, "n": n, "preempted": preempted, "minutes": round(minutes, 2),
        "reads_per_min": round(calls["reads"] / minutes, 1), "writes_per_min": round(calls["writes"] / minutes, 1),
        "reads_per_execution": round(calls["reads"] / n, 3), "quota_429": calls["quota_429"],
        "by_method": {name: m["requests"] for name, m in sorted(methods.items())},
        "detection_p50_s": common.rounded(common.percentile(delays, 0.5)),
        "detection_p95_s": common.rounded(common.percentile(delays, 0.95)),
        "undetected": n - len(result["events"]),
        "cpu_s_per_execution_hour": common.rounded(result["cpu_seconds"] / hours if hours else None),
        "longest_block_s": result["longest_block_s"], "longest_block_cpu_s": result.get("longest_block_cpu_s"),
        "import_on_loop_s": result["import_seconds_on_loop"],
        "errors": result["errors"],
    }


if __name__ == "__main__":
    child(Path(sys.argv[1]))

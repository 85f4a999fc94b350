"""Cloud Run reads of N deferred executions: the per-execution polling trigger vs the shared watcher.

Two triggers, side by side: ``old``, the trigger of the release before the shared watcher (its
provider package from ``git archive`` of ``--old-ref``), and ``new``, this checkout's. Two modes,
one table (its ``mode`` column says which):

- ``deployment`` (``--deployment-sizes``, default N = 1, 10, 100): N deferred execute operators in
  a real Airflow deployment (PostgreSQL, scheduler with ``LocalExecutor``, DAG processor,
  triggerer, API server: ``scripts/airflow_stack.py``), their triggers in its triggerer, one
  stack per trigger; see :mod:`watch_scale_deployment`.
- ``event loop`` (``--loop-sizes``, default N = 1,000): the real trigger class, N triggers in one
  event loop of one process, as a triggerer runs them, where a deployment on two cores would not
  start N task instances in a reasonable time; see :mod:`watch_scale_loop`.

Each run has a fresh emulator state with Cloud Run's read quota of 600 per minute on, N
executions of one short task each, a seeded share of them preempted once (Cloud Run retries the
task). Reported per run: reads and writes per minute, 429s, detection delay (an execution's end
to its trigger's event, and in the deployment to its task's end) p50 and p95, the triggers'
CPU seconds per execution-hour (the triggerer's, in the deployment), the longest event-loop
block. Printed first: the import time of each trigger module over ``import airflow.triggers.base``.

Targets (the new watcher): at most 300 reads a minute at the largest N, detection p95 at most
twice the poll interval, reads per execution falling with N in each mode, the longest block of
the event loop under 0.1 s, and the trigger's import under 0.2 s.

    .venv/bin/python benchmarks/bench_watch_scale.py                 # both modes, old and new
    .venv/bin/python benchmarks/bench_watch_scale.py --deployment-sizes 1,10 --loop-sizes '' --variants new
    .venv/bin/python benchmarks/bench_watch_scale.py --deployment-sizes '' --variants new --update  # one row
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODES = ("deployment", "event loop")


def old_source(ref: str, workdir: Path) -> Path:
    """The provider package as of ``ref`` (``git archive``), in ``workdir/old-src``; ``auto``: the
    parent of the commit that added the shared watcher (``triggers/execution_watcher.py``)."""
    if ref == "auto":
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


HEADERS = ["mode", "trigger", "N", "preempted", "reads/min", "steady reads/min", "writes/min", "reads/exec",
           "429s", "detect p50 s", "detect p95 s", "task end p95 s", "undetected", "failed", "CPU s/exec-h",
           "longest block s"]


def _block(row: dict) -> str | float | None:
    """The longest block's cell: in the deployment, ``< threshold`` when the triggerer logged none."""
    if row["longest_block_s"] is None and row.get("block_threshold_s"):
        return f"< {row['block_threshold_s']}"
    return row["longest_block_s"]


def table_rows(rows: list) -> list:
    """:return: the table's cells per row (:data:`HEADERS`); a figure a mode does not measure is blank."""
    return [[r["mode"], r["variant"], r["n"], r["preempted"], r["reads_per_min"], r.get("steady_reads_per_min"),
             r["writes_per_min"], r["reads_per_execution"], r["quota_429"], r["detection_p50_s"],
             r["detection_p95_s"], r.get("task_end_p95_s"), r["undetected"], r.get("failed"),
             r["cpu_s_per_execution_hour"], _block(r)] for r in rows]


def targets(rows: list, poll: float, imports: dict) -> dict:
    """The issue's targets, checked on the new watcher's rows (the longest block on the event loop's
    watchdog: the deployment's figure from Airflow counts its watchdog's 0.1 s sleep)."""
    new = [r for r in rows if r["variant"] == "new"]
    big = max(new, key=lambda r: r["n"], default=None)
    falling = []
    for mode in MODES:
        mine = sorted((r for r in new if r["mode"] == mode), key=lambda r: r["n"])
        per_exec = [r["reads_per_execution"] for r in mine]
        falling.append(all(a > b for a, b in zip(per_exec, per_exec[1:])))
    return {
        "reads_per_min_at_largest_n_le_300": bool(big) and big["reads_per_min"] <= 300,
        "detection_p95_le_2x_poll": all(r["detection_p95_s"] is not None and r["detection_p95_s"] <= 2 * poll
                                        for r in new),
        "reads_per_execution_falling_with_n": all(falling),
        "longest_block_lt_0_1_s": all(r["longest_block_s"] < 0.1 for r in new if r["mode"] == "event loop"),
        "trigger_import_lt_0_2_s": imports.get("new", 1.0) < 0.2,
    }


def plot(path: Path, rows: list) -> bool:
    """Reads per minute and detection p95 against N, old and new, each mode; :return: whether drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for variant, colour in (("old", "tab:red"), ("new", "tab:green")):
        for mode, style in zip(MODES, ("o-", "s--")):
            mine = sorted((r for r in rows if r["variant"] == variant and r["mode"] == mode), key=lambda r: r["n"])
            if not mine:
                continue
            label = f"{variant}, {mode}"
            axes[0].plot([r["n"] for r in mine], [r["reads_per_min"] for r in mine], style, color=colour, label=label)
            axes[1].plot([r["n"] for r in mine], [r["detection_p95_s"] or 0 for r in mine], style, color=colour,
                         label=label)
    axes[0].axhline(600, color="black", linestyle="--", linewidth=0.8, label="read quota")
    for ax, title in zip(axes, ("Cloud Run reads per minute", "detection delay p95 (s)")):
        ax.set_xscale("log")
        ax.set_xlabel("concurrent executions watched")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def _sizes(text: str, flag: str) -> list:
    try:
        sizes = [int(size) for size in text.split(",") if size.strip()]
    except ValueError:
        sizes = [0]
    if any(size < 1 for size in sizes):
        raise SystemExit(f"{flag}: must be positive whole numbers separated by commas (or empty), got {text!r}")
    return sizes


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployment-sizes", default="1,10,100",
                        help="N values through a real deployment's triggerer, comma-separated (default 1,10,100)")
    parser.add_argument("--loop-sizes", default="1000",
                        help="N values through the trigger class in one event loop (default 1000)")
    parser.add_argument("--variants", nargs="+", default=["old", "new"], choices=["old", "new"])
    parser.add_argument("--old-ref", default="auto", help="git ref of the old provider (default: the parent of the "
                        "commit that added triggers/execution_watcher.py)")
    parser.add_argument("--poll", type=float, default=10.0, help="the triggers' poll_interval, s (default 10)")
    parser.add_argument("--spread", type=float, default=90.0, help="s over which the executions end (default 90)")
    parser.add_argument("--preempt-share", type=float, default=0.1, help="share preempted once (default 0.1)")
    parser.add_argument("--read-quota", type=int, default=600, help="reads per minute per region (default 600)")
    parser.add_argument("--seed", type=int, default=1)
    loop = parser.add_argument_group("event-loop mode")
    loop.add_argument("--end-after", type=float, default=30.0, help="s from the triggers' start to the first end")
    loop.add_argument("--retry-seconds", type=int, default=5, help="a retried attempt's sleep, s (default 5)")
    loop.add_argument("--cap-after", type=float, default=90.0, help="s after the last end before giving up")
    deployment = parser.add_argument_group("deployment mode")
    deployment.add_argument("--hold", type=float, default=40.0,
                            help="s from every trigger running to the first release (default 40)")
    deployment.add_argument("--parallelism", type=int, default=8,
                            help="[core] parallelism: task processes at once (default 8)")
    deployment.add_argument("--block-threshold", type=float, default=0.15,
                            help="[triggerer] blocked_main_thread_warning_threshold, s (default 0.15)")
    deployment.add_argument("--run-timeout", type=float, default=900.0,
                            help="s from a DAG run's trigger until every trigger must run (default 900)")
    parser.add_argument("--update", action="store_true",
                        help="replace only the rows this run measures (mode, trigger, N) in the results file and keep "
                             "its other rows, each dated by its run (default: write this run's rows only)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    args.deployment_sizes = _sizes(args.deployment_sizes, "--deployment-sizes")
    args.loop_sizes = _sizes(args.loop_sizes, "--loop-sizes")
    return args


def run_all(args: argparse.Namespace, sources: dict, workdir: Path) -> list:
    """Every deployment variant, then every (N, trigger) of the event loop; :return: the rows."""
    import common
    import watch_scale_deployment
    import watch_scale_loop

    rows: list = []
    for variant in args.variants if args.deployment_sizes else ():
        mine = watch_scale_deployment.run_variant(variant, sources[variant], args.deployment_sizes, args, workdir)
        for row in mine:
            row["block_threshold_s"] = args.block_threshold
        rows += mine
        print(common.table(HEADERS, table_rows(mine)), flush=True)
    for n in args.loop_sizes:
        for variant in args.variants:
            rows.append(watch_scale_loop.run_cell(variant, sources[variant], n, args, workdir))
            print(common.table(HEADERS, table_rows(rows[-1:])).splitlines()[-1], flush=True)
    return rows


def watched_by(args: argparse.Namespace, rows: list) -> dict:
    """What each mode ran (the sizes of ``rows``), in words (the report's and the table's header)."""
    sizes = {mode: sorted({r["n"] for r in rows if r["mode"] == mode}) for mode in MODES}
    return {
        "deployment": f"N = {sizes['deployment']}: N deferred execute operators in a real Airflow deployment "
                      f"(PostgreSQL, LocalExecutor with parallelism {args.parallelism}, DAG processor, triggerer, API "
                      "server), their triggers in its triggerer; every Cloud Run request of the region counted",
        "event loop": f"N = {sizes['event loop']}: the real CloudRunGpuExecutionTrigger class of each source tree, N of "
                      "them in one event loop of one process, over gRPC to the emulator (a deployment on two cores "
                      "does not start that many task instances in a reasonable time)",
    }


def main(argv=None) -> int:
    """Run both modes; print the table; write JSON (and PNG). :return: 0."""
    args = parse_args(argv)
    sys.path.insert(0, str(HERE))
    import common
    import watch_scale_loop

    common.apply_offline_env()
    common.stop_on_sigterm()
    os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="bench-watch-airflow-"))
    machine, started = common.machine_info(), time.monotonic()
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="bench-watch-"))).resolve()
    sources = {"new": None, "old": old_source(args.old_ref, workdir) if "old" in args.variants else None}
    imports = {variant: watch_scale_loop.import_seconds(sources[variant]) for variant in args.variants}
    print("trigger module import over `import airflow.triggers.base` (s): "
          + ", ".join(f"{v} {s}" for v, s in imports.items()), flush=True)
    rows, earlier = run_all(args, sources, workdir), []
    machine["load_at_end"] = common.load()
    if args.update:  # the earlier run's rows and import times of what this run did not measure stay
        report = common.read_report(args.out / "watch_scale.json")
        rows, earlier = common.merge_rows(report, rows, lambda r: (r["mode"], r["variant"], r["n"]), machine)
        imports = {**report.get("import_seconds", {}), **imports}
    report = {"benchmark": "watch_scale", "machine": machine, "elapsed_s": round(time.monotonic() - started, 1),
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "workdir")},
              "watched_by": watched_by(args, rows), "import_seconds": imports, "rows": rows, "earlier_runs": earlier,
              "targets": targets(rows, args.poll, imports), "workdir": str(workdir)}
    lines = [*common.machine_lines(machine), *(f"{mode}: {text}" for mode, text in report["watched_by"].items()),
             f"poll_interval {args.poll} s; read quota {args.read_quota}/min; the deployment's blocked-loop "
             f"threshold {args.block_threshold} s (Airflow's figure counts its watchdog's 0.1 s sleep)",
             f"trigger import (s): {imports}",
             *(f"rows of the run of {r['date']} kept (load {r['load_at_start']} to {r['load_at_end']})" for r in earlier),
             common.table(HEADERS, table_rows(rows)),
             f"targets (new watcher): {report['targets']}"]
    print("\n".join(lines))
    report["table"] = lines
    common.write_json(args.out / "watch_scale.json", report)
    drawn = plot(args.out / "watch_scale.png", rows)
    print(f"[watch_scale] wrote {args.out / 'watch_scale.json'}" + (" and watch_scale.png" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

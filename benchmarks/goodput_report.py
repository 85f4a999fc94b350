"""The report ``bench_goodput.py`` prints (and the documentation shows, from its JSON): the runs'
table, the goodput account's table, the downtime's parts, the targets' verdicts, and the plot of
goodput and lost work against the mean time between preemptions.
"""

from __future__ import annotations

from pathlib import Path

import common
from goodput_analysis import DOWNTIME_PARTS, STRATEGIES


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

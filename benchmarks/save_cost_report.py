"""The tables ``bench_save_cost.py`` prints (and the documentation shows, from its JSON): the
chunk digests, the end-to-end runs, the sweep and the I/O in the folder, with the overhead
ratios against the raw write bandwidth (the probe, in place and by the raw run's cost).
"""

from __future__ import annotations

import statistics
from typing import Any

import common


def render(result: dict[str, Any]) -> str:
    lines = common.machine_lines(result["machine"])
    lines.append(f"state {result['size_mib']} MiB, {result['steps']} steps, a save every {result['every']} steps; "
                 f"folder {result['dir']} ({result['dir_kind']}); nice {result['nice']}")
    lines.append("")
    lines.append("chunk digests (GB/s, best of 3)")
    for name, rate in result["digests"].items():
        lines.append(f"  {name:36s} {rate:8.3f}")
    bandwidth = result["raw_write_bytes_per_s"]
    if result["runs"]:  # none with --skip-e2e
        lines.append("")
        lines.extend(_e2e_lines(result, bandwidth))
    lines.extend(_grid_lines(result))
    lines.extend(_io_lines(result.get("io")))
    return "\n".join(lines)


def _e2e_lines(result: dict[str, Any], bandwidth: float) -> list[str]:
    lines = [f"end to end (raw write bandwidth {bandwidth / 1e6:.0f} MB/s)"]
    lines.append(f"  (wall: the fastest of {result['repeats']} interleaved runs, the one least slowed by other load;"
                 " median: of all of them)")
    in_place, in_run = in_place_bandwidth(result["runs"]), raw_run_bandwidth(result["runs"])
    if in_place:
        lines.append(f"  (in place, by the raw runs' own writes: {in_place / 1e6:.0f} MB/s"
                     + (f"; by the raw run's cost: {in_run / 1e6:.0f} MB/s" if in_run else "")
                     + "; ratio: against the probe / in place" + (" / the raw run's cost)" if in_run else ")"))
    lines.append(f"  {'mode':22s} {'wall s':>8s} {'median s':>8s} {'overhead s':>10s} {'bytes/raw bw s':>14s} {'ratio':>18s}"
                 f" {'peak RSS GB':>11s}")
    for name, run in result["runs"].items():
        ideal = run["bytes_written"] / bandwidth
        overhead = run["wall_s"] - result["runs"]["none"]["wall_s"]
        ratio = _ratios(overhead, run["bytes_written"], bandwidth, in_place, in_run)
        median = statistics.median(run.get("wall_all_s") or [run["wall_s"]])
        lines.append(f"  {name:22s} {run['wall_s']:8.2f} {median:8.2f} {overhead:10.2f} {ideal:14.2f} {ratio:>18s} "
                     f"{run['peak_rss_bytes'] / 1e9:11.2f}")
    return lines


def _grid_lines(result: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if result.get("grid"):
        lines.append("")
        lines.append("sweep: wall s, the fastest / the median of the interleaved runs; ratio = (fastest - none) /"
                     " (bytes / raw write bandwidth), target <= 1.2, against the probe (one write between runs,"
                     " the median of one a round), in place (the raw runs' own writes, the median run) and by the raw run's"
                     " cost (the fastest raw run's bytes over its wall time beyond none: a checkpoint's cost against"
                     " a raw writer's in the same loop)")
        modes = [name for name in (*RAW_MODES, "sync", "async") if any(name in p["runs"] for p in result["grid"])]
        lines.append(f"  {'MiB':>5s} {'every':>5s} {'threads':>7s} {'probe MB/s':>10s} {'in place':>8s} {'none':>13s} "
                     + " ".join(f"{name:>13s}" for name in modes) + " "
                     + " ".join(f"{name + ' ratio':>20s}" for name in modes) + "  async <= sync (fastest, median)")
        for point in result["grid"]:
            runs, bandwidth = point["runs"], point["raw_write_bytes_per_s"]
            in_place, in_run = in_place_bandwidth(runs), raw_run_bandwidth(runs)
            none = runs["none"]["wall_s"]

            def median(name: str) -> float:
                return statistics.median(runs[name].get("wall_all_s") or [runs[name]["wall_s"]])

            def walls(name: str) -> str:
                return f"{runs[name]['wall_s']:.2f} / {median(name):.2f}" if name in runs else "-"

            def ratio(name: str) -> str:
                run = runs.get(name)
                if not run:
                    return "-"
                return _ratios(run["wall_s"] - none, run["bytes_written"], bandwidth, in_place, in_run)

            def verdict(first: str, second: str) -> str:
                if first not in runs or second not in runs:
                    return "-"
                fastest = runs[first]["wall_s"] <= runs[second]["wall_s"]
                return f"{'yes' if fastest else 'NO'}, {'yes' if median(first) <= median(second) else 'NO'}"

            place = f"{in_place / 1e6:8.0f}" if in_place else f"{'-':>8s}"
            lines.append(f"  {point['size_mib']:5d} {point['every']:5d} {point['threads'] or 'dflt':>7} {bandwidth / 1e6:10.0f} "
                         f"{place} {walls('none'):>13s} " + " ".join(f"{walls(name):>13s}" for name in modes) + " "
                         + " ".join(f"{ratio(name):>20s}" for name in modes) + f"  {verdict('async', 'sync')}")
    return lines


def _io_lines(io: dict[str, Any] | None) -> list[str]:
    lines: list[str] = []
    if io:
        lines.append("")
        lines.append(f"I/O in the folder ({io['bytes'] / 1e6:.0f} MB checkpoint)")
        lines.append(f"  checkpoint write {io['checkpoint_write_s']:.2f} s vs raw write {io['raw_write_s']:.2f} s: "
                     f"{100 * io['write_ratio']:.0f} % of raw (target >= 80 %)")
        lines.append(f"  restore {io['restore_s']:.2f} s vs raw read {io['raw_read_s']:.2f} s: "
                     f"{100 * io['restore_ratio']:.0f} % of raw (target >= 80 %)"
                     + (f"; fastest of {len(io['restore_all_s'])} each, all: restore "
                        + ", ".join(f"{x:.2f}" for x in io["restore_all_s"]) + "; raw read "
                        + ", ".join(f"{x:.2f}" for x in io["raw_read_all_s"]) if io.get("restore_all_s") else ""))
        if io.get("raw_read_to_memory_s") is not None:
            lines.append(f"  restore vs a raw read into new memory of the file's size {io['raw_read_to_memory_s']:.2f} s "
                         f"(the least a loader that keeps the bytes does): {100 * io['restore_ratio_to_memory_read']:.0f} %")
        lines.append(f"  bytes read per restore {io['bytes_read_per_restore']} = "
                     f"{io['bytes_read_per_restore'] / io['bytes']:.2f} x the checkpoint (target 1)")
        if io.get("fuse_bytes_read_per_restore") is not None:
            events = io["fuse_events"]
            lines.append(f"  FUSE volume's count of bytes read per restore {io['fuse_bytes_read_per_restore']}; "
                         f"staged writes {events['staged']}, throttled rewrites {events['throttled']}, "
                         f"non-atomic renames {events['nonAtomicRenames']}")
        lines.append(f"  restart to first step {io['restart_to_first_step_s']:.2f} s vs start + raw read "
                     f"{io['start_plus_raw_read_s']:.2f} s: {io['restart_ratio']:.2f} x (target <= 1.5)")
        for kind, runs in (io.get("restart_phases_s") or {}).items():
            for phases in runs:
                lines.append(f"    {kind:7s} " + ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases.items()))
    return lines


def _ratios(overhead: float, written: int, probe: float, in_place: float | None,
            in_run: float | None = None) -> str:
    """:return: ``overhead / (written / bandwidth)`` against the probe and, when measured, in place
    and by the raw run's cost (``"1.20 / 0.95 / 1.05"``), or ``"-"`` for a run that wrote nothing."""
    if not written:
        return "-"
    bandwidths = [probe, in_place, in_run] if in_run else [probe, in_place] if in_place else [probe]
    return " / ".join(f"{overhead / (written / bandwidth):.2f}" if bandwidth else "-" for bandwidth in bandwidths)


#: The end-to-end modes that write raw bytes instead of checkpoints.
RAW_MODES = ("raw", "raw-wb")


def in_place_bandwidth(runs: dict[str, Any]) -> float | None:
    """:return: the raw write bandwidth in place (bytes/s): of each raw mode that ran (``raw``,
    ``raw-wb``), the median over its runs, and of those the higher (the best a plain writer did:
    the fair baseline); ``None`` when no raw mode ran."""
    medians = [statistics.median(rates) for name in RAW_MODES
               if (rates := (runs.get(name) or {}).get("in_place_bytes_per_s_all"))]
    return max(medians) if medians else None


def raw_run_bandwidth(runs: dict[str, Any]) -> float | None:
    """:return: the raw write bandwidth by its cost to the run (bytes/s): of each raw mode that ran,
    its bytes over its wall time beyond the run with no saves (the fastest of each), and of those
    the higher. It is what writing the state's bytes raw at the same steps costs the same training
    loop, so ``overhead / (bytes / this)`` is a checkpoint's cost against a raw writer's in the same
    run (1.0: the same). ``None`` when no raw mode ran, no ``none`` run is there, or every raw run
    was no slower than ``none`` (a cost of zero or less gives no bandwidth)."""
    if "none" not in runs:
        return None
    none = runs["none"]["wall_s"]
    rates = [run["bytes_written"] / (run["wall_s"] - none) for name in RAW_MODES
             if (run := runs.get(name)) and run.get("bytes_written") and run["wall_s"] > none]
    return max(rates) if rates else None

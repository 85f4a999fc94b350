"""What ``scripts/demo.py`` reads back from its run and prints: the execute operator's summary
from the Airflow database, the goodput account beside the emulator's own attempt times, the
worker's metrics, and the report (``report.json`` and the text ``make demo`` prints, which
``scripts/docs_sample_report.py`` renders again for the documentation's sample).
"""

from __future__ import annotations

import json
from pathlib import Path

from cloud_run_emulator.process import EmulatorProcess


def _read_json(path: Path) -> dict:
    """The JSON object in ``path``, or ``{}`` when it is missing or torn."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _execute_summary(workdir: Path) -> dict:
    """The execute operator's summary (its ``return_value`` XCom) from the Airflow DB, or ``{}``."""
    import sqlite3

    database = workdir / "airflow-home" / "airflow.db"
    if not database.exists():
        return {}
    with sqlite3.connect(database) as db:
        rows = db.execute("SELECT value FROM xcom WHERE key = 'return_value'").fetchall()
    for (value,) in rows:
        try:
            found = json.loads(value if isinstance(value, str) else bytes(value).decode())
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(found, dict) and "goodput" in found:
            return found
    return {}


def goodput_report(workdir: Path, emulator: EmulatorProcess) -> dict | None:
    """The summary's goodput report, with the emulator's own attempt times beside it (its attempt
    records outlive the job, which the DAG's cleanup deleted)."""
    summary = _execute_summary(workdir)
    report = summary.get("goodput") or None
    if report is None:
        return None
    from datetime import datetime

    attempts = [a for e in summary.get("executions", []) for a in emulator.attempts(e["name"])]
    starts = [datetime.fromisoformat(a["startTime"]).timestamp() for a in attempts if a.get("startTime")]
    ends = [datetime.fromisoformat(a["endTime"]).timestamp() for a in attempts]
    report["platform"] = {"attempts": len(attempts), "attempt_seconds": round(sum(a["seconds"] for a in attempts), 3),
                          "span_seconds": round(max(ends) - min(starts), 3) if starts else None}
    return report


def logging_requests(emulator: EmulatorProcess) -> int | None:
    """Cloud Logging ``entries:list`` requests the emulator served (its health endpoint)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{emulator.endpoint}/_emulator/health", timeout=10) as answer:
            return json.loads(answer.read()).get("loggingRequests")
    except (OSError, ValueError):
        return None


def build_summary(emulator: EmulatorProcess, dag_id: str, folder: Path | None, rc: int, preempter,
                  reference: dict | None, goodput: dict | None = None) -> dict:
    """The demo's report (``report.json``): the DAG run's state, the executions and attempts the
    worker recorded, the preemptions injected, the accuracy, whether the model is bit-identical
    to the reference run's, the goodput account and the checkpoint volume.

    :param folder: the task's checkpoint folder (its ``metrics.json``), ``None`` when there is none.
    :param rc: the exit status of ``airflow dags test`` (0: the DAG run succeeded).
    :param preempter: the demo's preemption injector (its ``records`` and ``error``).
    :param reference: the uninterrupted reference run's metrics, ``None`` when it did not run.
    """
    metrics = _read_json(folder / "metrics.json") if folder else {}
    attempts = metrics.get("attempts") or metrics.get("history", [])
    identical = None
    if reference is not None and metrics:
        identical = all(metrics.get(k) == reference.get(k) for k in ("model_sha256", "optimizer_sha256"))
    return {
        "dag_id": dag_id,
        "dag_run_state": "success" if rc == 0 else "failed",
        "executions": sorted({a.get("execution") for a in attempts if a.get("execution")}),
        "attempts": attempts,
        "preemptions": preempter.records,
        "preempter_error": preempter.error,
        "accuracy": metrics.get("accuracy"),
        "model_sha256": metrics.get("model_sha256"),
        "reference_model_sha256": (reference or {}).get("model_sha256"),
        "identical_to_uninterrupted_run": identical,
        "metrics": metrics,
        "goodput": goodput,
        "volumes": emulator.volumes(),
    }


def _volume_line(volumes: dict) -> str:
    """Which checkpoint volume the tasks had, and what it recorded (see docs/emulator-fuse.rst)."""
    if volumes.get("type") != "fuse":
        return f"checkpoint volume: plain folder ({volumes.get('reason') or 'FUSE off'}); gcsfuse semantics not checked"
    s = volumes.get("summary", {})
    reads = sum(s.get("bytesRead", {}).values())
    events = ", ".join(f"{name} {count}" for name, count in (
        ("staged writes", s.get("staged", 0)), ("throttled rewrites", s.get("throttled", 0)),
        ("non-atomic renames", s.get("nonAtomicRenames", 0)), ("ESTALE", s.get("estale", 0))) if count) or "none"
    causes = ", ".join(f"{c} {n}" for c, n in s.get("causes", {}).items())
    return (f"checkpoint volume: FUSE (Cloud Storage FUSE semantics{', strict' if volumes.get('strict') else ''}): "
            f"{s.get('staged', 0)} staged-write fallbacks{f' ({causes})' if causes else ''}, "
            f"{s.get('throttled', 0)} throttled rewrites; events: {events}; {reads / 1e6:.1f} MB read")


def _preemption_line(p: dict) -> str:
    """One injected preemption: where it landed and how the attempt ended."""
    how = f"exit code {p['exit_code']}" if p.get("exit_code") is not None else f"signal {p.get('term_signal')}"
    where = f"at step {p['injected_at_step']}"
    if p.get("checkpoint_being_written") is not None:
        landed = "inside" if p.get("landed_during_write") else "just after"
        where = f"{landed} the write of checkpoint step {p['checkpoint_being_written']}"
    return f"preemption: task {p['task_index']}, attempt {p.get('attempt')}, {where} -> {how}"


def print_report(summary: dict, log_path: Path) -> None:
    """Print ``summary`` (:func:`build_summary`) as the demo's report, ``log_path`` as its Airflow log."""
    print("\n==== airflow-gpu-resilience demo report ====")
    print(f"DAG run {summary['dag_id']}: {summary['dag_run_state'].upper()}   (Airflow log: {log_path})")
    print(f"executions: {len(summary['executions'])} {summary['executions']}; task attempts: {len(summary['attempts'])}")
    for p in summary["preemptions"]:
        print(_preemption_line(p))
    if summary["preempter_error"]:
        print(f"preemption injector error: {summary['preempter_error']}")
    print(_volume_line(summary["volumes"]))
    for a in summary["attempts"]:
        if a.get("unrecorded"):
            print(f"attempt {a.get('attempt')}: stopped before it resumed (listed by the next attempt)")
            continue
        start = f"resumed from step {a.get('resumed_from_step')}" if a.get("resumed_from_step") else "started from step 0"
        print(f"attempt {a.get('attempt')}: {start}, work lost {a.get('lost_steps', 0)} steps")
    if summary["accuracy"] is not None:
        print(f"held-out accuracy: {summary['accuracy']:.4f} after {summary['metrics'].get('steps')} steps")
    if summary["identical_to_uninterrupted_run"] is not None:
        verdict = "yes" if summary["identical_to_uninterrupted_run"] else "NO"
        print(f"final model bit-identical to an uninterrupted run with the same seed: {verdict} "
              f"(model sha256 {str(summary['model_sha256'])[:16]}...)")
    goodput = summary.get("goodput")
    if goodput:
        print("goodput account (seconds, share of the span):")
        print(goodput["table"])
        platform = goodput.get("platform") or {}
        print(f"attempts' wall time as the emulator recorded it: {platform.get('span_seconds')} s from first start "
              f"to last end, {platform.get('attempt_seconds')} s in {platform.get('attempts')} attempts")
    print("============================================")

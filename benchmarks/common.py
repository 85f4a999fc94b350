"""Helpers shared by the benchmarks.

Machine description and load, the offline google-auth environment, ``run_v2`` / Storage
clients on the emulator, the digits dataset, worker log parsing, the emulator's request counters
summed into reads, writes and 429s (:func:`api_calls`), a counting HTTP proxy (for counts by
request path, which the emulator's per-method counters do not give), text tables and result
files (an update of some rows of one: :func:`merge_rows`), and the raw I/O the checkpoint
benchmarks measure against (:func:`timed`, :func:`drop_cache`, :func:`raw_write`,
:func:`raw_read`). Nothing here imports Airflow.
"""

from __future__ import annotations

import datetime
import http.client
import http.server
import io
import json
import os
import platform
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional
from urllib.parse import urlsplit

from cloud_run_emulator.process import OFFLINE_ENV  # google-auth stays offline

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
PROJECT = "bench-project"
REGION = "us-central1"
PARENT = f"projects/{PROJECT}/locations/{REGION}"
MIB = 1 << 20
#: The size of each write and read of the raw I/O (:func:`raw_write`, :func:`raw_read`).
CHUNK = 8 << 20


def apply_offline_env() -> None:
    """Set :data:`OFFLINE_ENV` in this process (task processes inherit the emulator's env)."""
    os.environ.update(OFFLINE_ENV)


class Stopped(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM, so that every ``with`` block stops what it started."""


def stop_on_sigterm() -> None:
    """Turn SIGTERM into :class:`Stopped` (emulators and DAG runs are then stopped on the way out)."""
    import signal

    def _raise(signum, _frame):
        raise Stopped(f"signal {signum}")

    signal.signal(signal.SIGTERM, _raise)


def join_all(threads: list) -> None:
    """Join ``threads`` in short waits, so that Ctrl-C and SIGTERM reach the main thread."""
    for thread in threads:
        while thread.is_alive():
            thread.join(0.5)


def cpu_model() -> str:
    """:return: the CPU model name from ``/proc/cpuinfo`` (or :func:`platform.processor`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load() -> list:
    """:return: ``os.getloadavg()`` rounded, as a list (1, 5, 15 minutes)."""
    return [round(x, 2) for x in os.getloadavg()]


def machine_info() -> dict:
    """:return: date (UTC), host CPU count and model, Python version and the load now."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "nproc": os.cpu_count(), "cpu_model": cpu_model(), "python": platform.python_version(),
        "load_at_start": load(),
    }


def machine_lines(info: dict) -> list:
    """:return: the header lines every benchmark prints (date, machine, load)."""
    return [f"date: {info['date']}",
            f"machine: {info['nproc']} CPUs, {info['cpu_model']}, Python {info['python']}",
            f"load average (1/5/15 min): start {info['load_at_start']}, end {info.get('load_at_end')}"]


def run_clients(endpoint: str) -> dict:
    """:return: ``{"jobs", "executions", "tasks"}`` REST clients on ``endpoint``."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import run_v2

    options = {"credentials": AnonymousCredentials(), "transport": "rest",
               "client_options": {"api_endpoint": endpoint}}
    return {"jobs": run_v2.JobsClient(**options), "executions": run_v2.ExecutionsClient(**options),
            "tasks": run_v2.TasksClient(**options)}


def completion_times(endpoint: str, project: str, region: str) -> dict:
    """Every ended execution of a region, from one paged ``ListExecutions`` of ``jobs/-`` over
    REST: Admin API reads, which the emulator's quota counts (read it with the quota off).

    :return: ``{execution name: {"job": its job's id, "end": its completionTime, epoch s}}``.
    """
    listing = run_clients(endpoint)["executions"].list_executions(parent=f"projects/{project}/locations/{region}/jobs/-")
    return {e.name: {"job": e.name.split("/")[5], "end": e.completion_time.timestamp()}
            for e in listing if e.completion_time}


def python_path(first: Optional[Path]) -> str:
    """:return: this process's ``PYTHONPATH`` with the folder ``first`` (a source tree) before its
    entries; unchanged when ``first`` is ``None``."""
    return os.pathsep.join(p for p in (str(first) if first else "", os.environ.get("PYTHONPATH", "")) if p)


def storage_client(gcs_endpoint: str):
    """:return: a ``google-cloud-storage`` client on the emulator's GCS endpoint."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": gcs_endpoint})


def digits_npz() -> bytes:
    """scikit-learn's digits as the worker's ``.npz`` (80/20 stratified split, seed 0)."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x, y = (digits.data / 16.0).astype("float32"), digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    buffer = io.BytesIO()
    np.savez(buffer, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return buffer.getvalue()


def parse_time(stamp: str) -> float:
    """:return: seconds since the epoch of an ISO-8601 UTC stamp like ``2026-12-01T07:38:00.23Z``."""
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def read_log_events(path: Path) -> list:
    """:return: the worker's JSON log lines in ``path`` as dicts with ``t`` (epoch seconds) added;
    other lines (tracebacks, emulator notes) are skipped."""
    events = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return events
    for line in lines:
        try:
            event = json.loads(line)
            event["t"] = parse_time(event["time"])
        except (ValueError, KeyError, TypeError):
            continue
        events.append(event)
    return events


def median(values: Iterable[float]) -> Optional[float]:
    """:return: the median of ``values``, or ``None`` when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def percentile(values: Iterable[float], q: float) -> Optional[float]:
    """:return: the ``q`` quantile (0..1) of ``values`` by nearest rank, or ``None`` when there are none."""
    ordered = sorted(values)
    return None if not ordered else ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def rounded(value: Optional[float], digits: int = 2) -> Optional[float]:
    """:return: ``value`` rounded to ``digits`` decimals, ``None`` as ``None``."""
    return None if value is None else round(value, digits)


def api_calls(methods: dict) -> dict:
    """Reads, writes and 429s of the emulator's request counters, a write being a method that
    changes state (the emulator's own table, which its quota uses too).

    :param methods: ``{method: {"requests", "quotaExceeded"}}`` (``/_emulator/requests``' ``methods``).
    :return: ``{"reads", "writes", "quota_429"}``.
    """
    from cloud_run_emulator.rpcs import RPCS

    writes = {rpc.method for rpc in RPCS.values() if rpc.mutating}
    return {"reads": sum(m["requests"] for name, m in methods.items() if name not in writes),
            "writes": sum(m["requests"] for name, m in methods.items() if name in writes),
            "quota_429": sum(m["quotaExceeded"] for m in methods.values())}


def table(headers: list, rows: list) -> str:
    """:return: ``rows`` (lists of cells) under ``headers`` as a Markdown table."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def read_report(path: Path) -> dict:
    """:return: the results file ``path`` as a dict; ``{}`` when it is missing or not a JSON object."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def merge_rows(earlier: dict, rows: list, key, run: dict) -> tuple:
    """An update of some rows of a results file: this run's rows replace the earlier report's rows
    of the same key, in place; the earlier rows this run did not measure are kept; every row says
    which run measured it (``run_date``).

    :param earlier: the earlier report (:func:`read_report`: ``machine`` and ``rows``); without
        its ``machine`` date (``{}``, say) nothing is kept.
    :param rows: this run's rows (dicts).
    :param key: a row's identity, e.g. ``lambda r: (r["mode"], r["variant"], r["n"])``.
    :param run: this run's :func:`machine_info` (its ``date`` dates the new rows).
    :return: ``(rows, earlier_runs)``: the merged rows, and for each earlier run that measured a
        kept row its date, load and ``config``.
    """
    fresh = {key(row): {**row, "run_date": run["date"]} for row in rows}
    earlier_date = earlier.get("machine", {}).get("date")
    if earlier_date is None:
        return list(fresh.values()), []
    merged = [fresh.pop(key(row), None) or {**row, "run_date": row.get("run_date", earlier_date)}
              for row in earlier.get("rows", [])]
    merged += fresh.values()
    runs = {r["date"]: r for r in earlier.get("earlier_runs", [])}
    runs[earlier_date] = {"date": earlier_date, "load_at_start": earlier["machine"].get("load_at_start"),
                          "load_at_end": earlier["machine"].get("load_at_end"), "config": earlier.get("config")}
    kept = sorted({row["run_date"] for row in merged} - {run["date"]})
    return merged, [runs[date] for date in kept if date in runs]


def write_json(path: Path, data: dict, limit: int = 100_000) -> int:
    """Write ``data`` as indented JSON; :return: its size. :raises ValueError: over ``limit`` bytes."""
    text = json.dumps(data, indent=1, sort_keys=False) + "\n"
    if len(text) > limit:
        raise ValueError(f"{path.name} would be {len(text)} bytes (limit {limit}); trim the data")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return len(text)


class CountingProxy:
    """A loopback HTTP proxy in front of the emulator that counts the requests it forwards.

    The emulator counts requests per project, region and method (``/_emulator/requests``, see
    :func:`api_calls`), not per path; for counts by path, clients are pointed at :attr:`endpoint`
    instead: every request is forwarded unchanged to ``target`` and counted by ``(method, kind)``,
    where kind is the resource the ``/v2`` path names (``executions``, ``tasks``, ``jobs``,
    ``operations``).

    :param target: the emulator's endpoint, ``http://127.0.0.1:PORT``.
    """

    def __init__(self, target: str) -> None:
        self._target = urlsplit(target).netloc
        self._lock = threading.Lock()
        self.counts: Counter = Counter()
        self.requests: list = []  # (epoch seconds, method, path)
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="counting-proxy", daemon=True)

    def __enter__(self) -> "CountingProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def record(self, method: str, path: str) -> None:
        with self._lock:
            self.counts[(method, classify_path(path))] += 1
            self.requests.append((time.time(), method, path))

    def count(self, predicate) -> Counter:
        """:return: the requests whose path satisfies ``predicate``, as ``"METHOD kind"`` counts."""
        with self._lock:
            return Counter(f"{m} {classify_path(p)}" for _t, m, p in self.requests if predicate(p))

    def _handler_class(self):
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.record(self.command, self.path)
                upstream = http.client.HTTPConnection(proxy._target, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                answer = upstream.getresponse()
                payload = answer.read()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                upstream.close()

            do_GET = do_POST = do_PATCH = do_DELETE = _forward

        return Handler


def classify_path(path: str) -> str:
    """:return: the resource kind of a ``/v2`` request path: its last collection name, singular
    for one resource, plus any custom verb (``.../jobs/j/executions/e`` -> ``execution``,
    ``.../executions/e/tasks`` -> ``tasks``, ``.../jobs/j:run`` -> ``job:run``)."""
    parts = [p for p in urlsplit(path).path.split("/") if p]
    if not parts or parts[0] != "v2":
        return "admin"
    last, _, verb = parts[-1].partition(":")
    parts[-1] = last
    if len(parts) % 2 == 0:  # /v2 + name/id pairs ... + collection: a list request
        kind = parts[-1]
    else:
        kind = parts[-2].rstrip("s")
    return f"{kind}:{verb}" if verb else kind


def timed(action) -> float:
    """:return: seconds ``action()`` took (``time.perf_counter``)."""
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def drop_cache(path: Path, ignore_errors: bool = False) -> None:
    """Ask the kernel to drop the clean cached pages of ``path`` (``POSIX_FADV_DONTNEED``; no root
    needed), so that the next read comes from the disk or the volume.

    :param ignore_errors: leave an :class:`OSError` unraised (a file gone, a file system that
        refuses the advice); by default it is raised.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError:
        if not ignore_errors:
            raise


def raw_write(path: Path, size: int, writeback: bool = False) -> float:
    """:return: seconds of a sequential write + fsync of ``size`` bytes to the new file ``path``,
    in :data:`CHUNK` writes from one buffer.

    :param writeback: start the writeback of each chunk as it is written
        (:func:`~gpu_resilience_worker.fastio.start_writeback`, as the checkpoint writer does),
        so that the closing fsync has little left; without it the whole flush waits for the fsync.
    """
    from gpu_resilience_worker.fastio import start_writeback

    buffer = memoryview(os.urandom(CHUNK))
    started = time.perf_counter()
    with open(path, "xb", buffering=0) as handle:
        offset = 0
        while offset < size:
            take = min(size - offset, CHUNK)
            handle.write(buffer[:take])
            if writeback:
                start_writeback(handle.fileno(), offset, take)
            offset += take
        os.fsync(handle.fileno())
    return time.perf_counter() - started


def raw_read(path: Path, into_new_memory: bool = False) -> tuple[float, int]:
    """:return: (seconds, bytes) of one sequential read of ``path`` into one reused buffer, or,
    with ``into_new_memory``, into new memory of its size (an anonymous mapping, its pages first
    touched by the read): the least any loader that keeps the bytes must do."""
    import mmap

    size = path.stat().st_size
    memory = mmap.mmap(-1, max(size, 1)) if into_new_memory else bytearray(CHUNK)
    view = memoryview(memory)
    started, total = time.perf_counter(), 0
    try:
        with open(path, "rb", buffering=0) as handle:
            while True:
                with (view[total : total + CHUNK] if into_new_memory else view[:]) as target:
                    count = handle.readinto(target)
                if not count:
                    break
                total += count
        return time.perf_counter() - started, total
    finally:
        view.release()
        if into_new_memory:
            memory.close()

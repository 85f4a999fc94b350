"""The ``benchmark-results`` directive: the benchmarks' tables, rendered from their JSON at build time.

Every figure on the benchmarks page comes from a file under ``benchmarks/results/`` that a
benchmark wrote; nothing is copied by hand::

    .. benchmark-results:: save_cost_*.json

Each matching file (sorted by name) becomes a heading with the file's name and a text block with
the tables the benchmark itself prints for it: its own renderer where it has one
(``bench_save_cost.render``, ``bench_checkpoint.render``, ``bench_goodput.report_lines``,
``bench_emulator.print_table``), the table it stored in its JSON (``table``), else a table of its
rows, else its top-level values. A results file that no directive of the site shows is reported
as a warning, which ``make docs`` (``-W``) turns into an error: a new benchmark's results are on
the page, or the build says so.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
logger = logging.getLogger(__name__)


def _benchmark(name: str):
    """Import ``benchmarks/<name>.py`` (the benchmarks import ``common`` from their folder)."""
    for path in (REPO / "benchmarks", REPO / "worker", REPO):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    return __import__(name)


def _save_cost(data: dict) -> str:
    return _benchmark("bench_save_cost").render(data)


def _checkpoint(data: dict) -> str:
    return _benchmark("bench_checkpoint").render(data["summary"])


def _goodput(data: dict) -> str:
    return "\n".join(_benchmark("bench_goodput").report_lines(data))


def _emulator_scale(data: dict) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _benchmark("bench_emulator").print_table(data["runs"])
    return printed.getvalue().rstrip("\n")


#: File name prefix -> the benchmark's own rendering of its JSON.
RENDERERS: dict[str, Callable[[dict], str]] = {
    "save_cost": _save_cost,
    "checkpoint": _checkpoint,
    "goodput": _goodput,
    "emulator_scale": _emulator_scale,
}


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)[:60]
    return str(value)


def rows_table(rows: dict[str, dict] | list[dict]) -> str:
    """A fixed-width table of flat records: one row per record, one column per scalar field.

    :param rows: records, or ``{name: record}`` (the name becomes the first column).
    :return: the table's lines joined by newlines.
    """
    named = rows.items() if isinstance(rows, dict) else ((None, row) for row in rows)
    records = [({"": name} if name is not None else {}) | {k: v for k, v in row.items()
                                                            if not isinstance(v, (dict, list))}
               for name, row in named]
    columns = list(dict.fromkeys(key for record in records for key in record))
    cells = [[_cell(record.get(column, "")) for column in columns] for record in records]
    widths = [max(len(column), *(len(row[i]) for row in cells)) for i, column in enumerate(columns)]
    lines = [" ".join(column.ljust(width) for column, width in zip(columns, widths))]
    lines.append(" ".join("-" * width for width in widths))
    lines += [" ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def render(name: str, data: dict) -> str:
    """The text that shows one results file: see the module docstring for the order of choice.

    :param name: the file's name, e.g. ``goodput.json``.
    :param data: its decoded JSON.
    :return: the text (machine and settings lines, tables, targets).
    """
    for prefix, renderer in RENDERERS.items():
        if name.startswith(prefix):
            return renderer(data)
    if isinstance(data.get("table"), list):
        return "\n".join(str(line) for line in data["table"])
    meta = data.get("meta") or data.get("machine") or {}
    head = [f"{key}: {_cell(value)}" for key, value in meta.items()]
    for key in ("results", "runs", "rows"):
        if isinstance(data.get(key), (dict, list)) and data[key]:
            return "\n".join(head + ["", rows_table(data[key])])
    return "\n".join(head + [f"{key}: {_cell(value)}" for key, value in data.items() if key not in ("meta", "machine")])


class BenchmarkResults(SphinxDirective):
    """One section per results file matching the argument (a glob under ``benchmarks/results/``)."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        paths = sorted(RESULTS.glob(self.arguments[0]))
        if not paths:
            logger.warning("benchmark-results: no file matches %s in %s", self.arguments[0], RESULTS,
                           location=self.get_location())
            return []
        shown = self.env.__dict__.setdefault("benchmark_results_shown", set())
        result: list[nodes.Node] = []
        for path in paths:
            shown.add(path.name)
            self.env.note_dependency(str(path))
            data = json.loads(path.read_text())
            rubric = nodes.rubric(text=path.name)
            block = nodes.literal_block(text=render(path.name, data), language="text")
            result += [rubric, block]
        return result


def check_every_file_shown(app, env) -> None:
    """Warn for each results file that no ``benchmark-results`` directive showed."""
    shown = getattr(env, "benchmark_results_shown", set())
    for path in sorted(RESULTS.glob("*.json")):
        if path.name not in shown:
            logger.warning("benchmark-results: %s is shown on no page (add it to docs/benchmarks.rst)",
                           path.relative_to(REPO))


def merge_shown(app, env, docnames, other) -> None:
    """Parallel reads: merge what the other process showed."""
    env.__dict__.setdefault("benchmark_results_shown", set()).update(getattr(other, "benchmark_results_shown", set()))


def setup(app):
    """Register the directive and the completeness check."""
    app.add_directive("benchmark-results", BenchmarkResults)
    app.connect("env-check-consistency", check_every_file_shown)
    app.connect("env-merge-info", merge_shown)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

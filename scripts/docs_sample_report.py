"""Refresh the documentation's sample ``make demo`` report from a real run.

``make demo`` writes its report as JSON (``report.json`` in the run's folder under
``demo-output/``). This copies one to ``docs/examples/demo-report.json`` and renders it, with the
demo's own report printer, into ``docs/examples/demo-report.txt``, which the "Getting started" page
includes and README.md shows. ``tests/unit/test_docs.py`` renders the JSON again and checks that
both copies of the text match it, so the sample is always one the demo printed::

    .venv/bin/python scripts/docs_sample_report.py [--report demo-output/demo-.../report.json]

Without ``--report`` it takes the newest ``demo-output/*/report.json``. Exit status 0, or 2 with
one message when there is no report to take.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "docs" / "examples"
SAMPLE_JSON = EXAMPLES / "demo-report.json"
SAMPLE_TEXT = EXAMPLES / "demo-report.txt"
#: The log path the sample shows instead of the run's own folder.
LOG_PLACEHOLDER = Path("/path/to/clone/demo-output/demo-.../airflow-dags-test.log")


def _demo():
    spec = importlib.util.spec_from_file_location("agr_demo_report", REPO / "scripts" / "demo_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render(report: dict) -> str:
    """The text the demo prints for ``report``, with :data:`LOG_PLACEHOLDER` as its log path.

    :param report: a demo report, as ``report.json`` holds it.
    :return: the report's lines, from the ``====`` header to the closing rule, newline-terminated.
    """
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _demo().print_report(report, LOG_PLACEHOLDER)
    return printed.getvalue().lstrip("\n")


def main(argv: list[str] | None = None) -> int:
    """Copy and render one report; :return: the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, default=None,
                        help="a demo's report.json (default: the newest under demo-output/)")
    args = parser.parse_args(argv)
    report = args.report
    if report is None:
        found = sorted((REPO / "demo-output").glob("*/report.json"), key=lambda p: p.stat().st_mtime)
        report = found[-1] if found else None
    if report is None or not report.is_file():
        parser.exit(2, f"{parser.prog}: no report to take: run `make demo` first, or pass --report PATH\n")
    text = render(json.loads(report.read_text()))
    shutil.copyfile(report, SAMPLE_JSON)
    SAMPLE_TEXT.write_text(text)
    print(f"{SAMPLE_JSON.relative_to(REPO)} and {SAMPLE_TEXT.relative_to(REPO)} from {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Reading the worker's structured log lines out of an attempt's log, for the tests."""

from __future__ import annotations

import json


def worker_records(text: str) -> list[dict]:
    """:return: the worker's structured records (one JSON object a line, with a ``message``) in an
    attempt's log text, in order; other lines (a library's warning on stderr) are skipped."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "message" in record:
            records.append(record)
    return records

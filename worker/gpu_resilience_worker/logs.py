"""Structured logs: one JSON object per line with ``severity`` and ``message``, which Cloud Logging parses from a
container's stdout."""

from __future__ import annotations

import datetime as _dt
import json
import sys
import threading
from typing import Any, TextIO


def utc_now() -> str:
    """:return: the current UTC time in RFC 3339 format with microseconds."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


class StructuredLogger:
    """Writes one JSON log record per line.

    :param stream: where to write; default ``sys.stdout`` at call time.
    :param context: fields added to every record (e.g. job, task index, attempt)."""

    def __init__(self, stream: TextIO | None = None, **context: Any) -> None:
        self._stream, self._context, self._lock = stream, dict(context), threading.Lock()

    def bind(self, **context: Any) -> StructuredLogger:
        """:return: a logger on the same stream with extra context fields."""
        return StructuredLogger(self._stream, **{**self._context, **context})

    def log(self, severity: str, message: str, **fields: Any) -> None:
        """Write one record.

        :param severity: Cloud Logging severity (DEBUG, INFO, WARNING, ERROR, CRITICAL).
        :param message: the human-readable message.
        :param fields: structured fields; values that are not JSON types are stringified."""
        record = {"severity": severity, "message": message, "time": utc_now(), **self._context, **fields}
        line = json.dumps(record, default=str)
        stream = self._stream or sys.stdout
        with self._lock:
            stream.write(line + "\n")
            stream.flush()

    def debug(self, message: str, **fields: Any) -> None:
        """Log at DEBUG."""
        self.log("DEBUG", message, **fields)

    def info(self, message: str, **fields: Any) -> None:
        """Log at INFO."""
        self.log("INFO", message, **fields)

    def warning(self, message: str, **fields: Any) -> None:
        """Log at WARNING."""
        self.log("WARNING", message, **fields)

    def error(self, message: str, **fields: Any) -> None:
        """Log at ERROR."""
        self.log("ERROR", message, **fields)

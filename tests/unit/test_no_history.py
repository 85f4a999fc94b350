"""No history in code: comments and docstrings say what and why, not when it was measured.

Measured figures live in ``benchmarks/results/`` (the documentation's benchmarks page renders
them) and the history in version control. A date (``YYYY-MM-DD``) in a comment or docstring of a
tracked file is history; a date inside an inline literal (an example value, ``scheduled__2026-...``)
and dates in code or test data are not. Pure file reading.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d")
_LITERAL = re.compile(r"``[^`]*``|`[^`]*`")


def _dated(text: str) -> bool:
    """A date outside an inline literal (an example value such as ``scheduled__2026-01-01...``)."""
    return bool(_DATE.search(_LITERAL.sub("", text)))


def dated_comment_lines(path: Path, source: str | None = None) -> list[int]:
    """Line numbers of comments and docstrings of ``path`` that carry a date: history, which
    belongs in the benchmark results and the version control log, not in the code.

    :param path: a Python file, or a Makefile or shell script (its ``#`` comment lines).
    :param source: its text (default: read from ``path``).
    :return: the offending line numbers, in order.
    """
    import ast
    import io
    import tokenize

    source = path.read_text() if source is None else source
    if path.suffix != ".py":
        return [n for n, line in enumerate(source.splitlines(), 1) if line.lstrip().startswith("#") and _dated(line)]
    found = {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT and _dated(token.string)}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                for offset, line in enumerate(first.value.value.splitlines()):
                    if _dated(line):
                        found.add(first.lineno + offset)
    return sorted(found)


def test_no_comment_or_docstring_carries_a_date() -> None:
    listed = subprocess.run(["git", "ls-files", "*.py", "Makefile", ".ci/run", "scripts/*.sh"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    assert "Makefile" in listed and len(listed) > 50
    problems = [f"{name}:{line}" for name in listed if (REPO / name).is_file()
                for line in dated_comment_lines(REPO / name)]
    assert not problems, ("dates in comments or docstrings (measurements belong in benchmarks/results/): "
                          + ", ".join(problems))


@pytest.mark.parametrize(("name", "source", "expected"), [
    ("a.py", "x = 1  # measured 2026-12-03: 5 s\n", [1]),
    ("a.py", '"""Module.\n\nRun of 2026-12-02 on 2 cores."""\n', [3]),
    ("a.py", 'def f():\n    """Uses ``2026-01-01T00:00:00Z`` as an example."""\n', []),
    ("a.py", 'STAMP = "2026-01-01"  # test data, not history\n', []),
    ("Makefile", "# (2 cores, 2026-12-03: 152 s)\nall:\n\techo 2026-12-03\n", [1]),
])
def test_dated_comment_lines_finds_history_not_data(name, source, expected) -> None:
    assert dated_comment_lines(Path(name), source) == expected

"""The worker distribution's two packages: the library (``gpu_resilience_worker``) and the bundled
trainer built on it (``gpu_resilience_trainer``). The trainer is an application of the library,
as a user's own script is: no module of the library imports it, not even inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "worker" / "gpu_resilience_worker"
TRAINER = "gpu_resilience_trainer"


def _imported_packages(path: Path) -> set[str]:
    """:return: the top-level package of every ``import`` and ``from ... import`` in ``path``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_no_library_module_imports_the_trainer() -> None:
    modules = sorted(LIBRARY.rglob("*.py"))
    assert len(modules) > 20, modules  # the walk found the library
    offenders = [str(path.relative_to(REPO)) for path in modules if TRAINER in _imported_packages(path)]
    assert not offenders, offenders


def test_one_entry_point_the_trainers() -> None:
    """``python -m gpu_resilience_trainer`` is the bundled trainer's only command: the library has
    no ``__main__`` beside it."""
    assert (REPO / "worker" / TRAINER / "__main__.py").is_file()
    assert not (LIBRARY / "__main__.py").exists()

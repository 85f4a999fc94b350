"""The operators stay thin: Airflow's ``context`` is read only where Airflow hands it over.

``execute`` and ``execute_complete`` (and a sensor's ``poke``) take the task's context and pass on what the rest needs (the
task instance); the run manager, the trigger, the hooks and the operators' other methods never
see it. Checked on the source (names and arguments called ``context``, and Airflow's
``get_current_context``), so that a new method that takes or fetches it fails here. Also the size budget of the operators' module and of the execute operator.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "airflow_gpu_resilience"
#: The methods Airflow calls with the context (a sensor's ``poke`` too).
CONTEXT_METHODS = {"execute", "execute_complete", "poke"}


def _uses_context(node: ast.AST) -> bool:
    """A name or argument ``context``, or Airflow's ``get_current_context`` (called or imported)."""
    return any((isinstance(n, ast.Name) and n.id in ("context", "get_current_context"))
               or (isinstance(n, ast.arg) and n.arg == "context")
               or (isinstance(n, ast.Attribute) and n.attr == "get_current_context")
               or (isinstance(n, ast.alias) and n.name.rsplit(".", 1)[-1] == "get_current_context")
               for n in ast.walk(node))


def _functions(tree: ast.Module):
    """Every function with the class it is defined in (``None`` at module level), outermost only."""
    for top in tree.body:
        if isinstance(top, ast.ClassDef):
            for item in top.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield top.name, item
        elif isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield None, top


@pytest.mark.parametrize("module", sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")))
def test_context_is_used_only_in_execute_and_execute_complete(module):
    tree = ast.parse((PACKAGE / module).read_text())
    assert not any(_uses_context(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))), \
        f"{module}: imports get_current_context"
    offenders = [f"{owner}.{function.name}" if owner else function.name
                 for owner, function in _functions(tree)
                 if _uses_context(function) and not (module.startswith(("operators/", "sensors/"))
                                                    and function.name in CONTEXT_METHODS)]
    # the links' persist(context, ...) is Airflow's and the google provider's convention for links
    offenders = [name for name in offenders if not (module == "links/cloud_run.py" and name.endswith(".persist"))]
    assert not offenders, f"{module}: context used in {offenders}"


def test_the_operators_module_and_the_execute_operator_within_their_budget():
    source = (PACKAGE / "operators" / "cloud_run.py").read_text()
    assert len(source.splitlines()) <= 400
    [execute] = [n for n in ast.parse(source).body
                 if isinstance(n, ast.ClassDef) and n.name == "CloudRunGpuExecuteJobOperator"]
    assert execute.end_lineno - execute.lineno + 1 <= 250

"""Sphinx configuration of the documentation site (``make docs``).

The build is offline: the API pages import the provider and the worker library from this checkout
(autodoc), with google-auth kept off the metadata server and Airflow's home in a throwaway folder.
References to classes of other projects (Airflow, the Google clients, torch, the standard library)
are not resolved, since no inventory of theirs can be fetched here; every reference into this
project's own pages and API must resolve (``make docs`` runs Sphinx with ``-n -W``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
for path in (ROOT, ROOT / "worker", DOCS / "_ext"):
    sys.path.insert(0, str(path))

# Before anything imports Airflow or google-auth: no probe of the metadata server, no ~/airflow.
os.environ.update({"NO_GCE_CHECK": "true", "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9",
                   "AIRFLOW__CORE__LOAD_EXAMPLES": "False"})
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="agr-docs-airflow-home-"))

import airflow_gpu_resilience  # noqa: E402

project = "airflow-gpu-resilience"
author = "the airflow-gpu-resilience authors"
copyright = "the airflow-gpu-resilience authors, Apache-2.0"  # noqa: A001 (Sphinx's name)
release = version = airflow_gpu_resilience.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "api_modules",
    "benchmark_tables",
]
exclude_patterns = ["_build", "examples/README.rst"]
html_theme = "furo"
html_title = f"airflow-gpu-resilience {release}"
# A literal block without a language is plain text, never guessed as Python.
highlight_language = "none"
pygments_style = "sphinx"

# Every member a module defines (constants and enum members included, so that docstrings can
# refer to them), not the names it merely re-exports (its ``__all__``): those are documented
# where they are defined.
autodoc_default_options = {"members": True, "undoc-members": True, "ignore-module-all": True,
                           "show-inheritance": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"

nitpicky = True
# Any dotted name of another project (no inventory offline) or of the standard library.
_EXTERNAL = r"(?!airflow_gpu_resilience\b|gpu_resilience_worker\b|gpu_resilience_trainer\b)[A-Za-z_]\w*\..+"
nitpick_ignore_regex = [
    # Private names (a base class, a type variable) appear in signatures and bases but are not documented.
    (r"py:.*", r"(.*\.)?_[A-Za-z]\w*"),
    # A generic annotation (``dict[str, int]``) that Sphinx split at its comma.
    (r"py:class", r".*\[.*"),
    (r"py:.*", _EXTERNAL),
    # Builtin types and typing names as they appear unqualified in annotations and docstrings.
    (r"py:(class|obj|data|exc)", r"(None|NoneType|Any|Self|Literal|Callable|Iterator|Iterable|Mapping|Sequence"
                                 r"|Collection|Awaitable|AsyncIterator|Generator|TypeVar|Protocol|T|ellipsis"
                                 r"|int|float|str|bytes|bool|dict|list|tuple|set|frozenset|object|type|Path"
                                 r"|BinaryIO|IO|Context|timedelta|datetime|Exception|BaseException|OSError"
                                 r"|ValueError|TypeError|KeyError|RuntimeError|SystemExit|TimeoutError)"),
]

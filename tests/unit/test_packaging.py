"""What the package declares and ships: requirements, extras, one version, LICENSE and py.typed.

The requirement lists below are the contract: a production install pulls only what the provider
imports; the example DAGs' dataset libraries and the development tools each sit in an extra that
installs something usable. The emulator is a distribution of its own (``emulator/``): the
provider's wheel carries none of its code and none of its servers' requirements, and the
emulator's requires no Airflow.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import airflow_gpu_resilience
from airflow_gpu_resilience.get_provider_info import get_provider_info

REPO = Path(__file__).resolve().parents[2]
DIST = "airflow-gpu-resilience"

#: Requirements of a production install (name -> specifier).
REQUIRED = {
    "apache-airflow": ">=2.11.0",
    "apache-airflow-providers-google": ">=15.0",
    "apache-airflow-providers-common-compat": ">=1.13.0",
    "google-cloud-run": ">=0.10",
    "google-cloud-storage": ">=2.14",
    "google-cloud-logging": ">=3.5",
    "google-api-core": ">=2.17",
    "packaging": ">=23",
}
#: Extras (name -> requirement names).
EXTRAS = {
    "examples": {"numpy", "scikit-learn", "google-cloud-artifact-registry"},
    "dev": {"pytest", "pytest-xdist", "torch", "matplotlib", "build"},
    "deployment": {"psycopg2-binary", "asyncpg", "apache-airflow-client", "selenium"},
    "docs": {"sphinx", "furo"},
}
#: Never part of a production install: the emulator's servers (in no extra of the provider either).
SERVER_ONLY = {"fastapi", "uvicorn", "gcp-storage-emulator", "mfusepy"}


def _requirements() -> list[Requirement]:
    return [Requirement(r) for r in metadata.requires(DIST) or []]


def _extra_of(req: Requirement) -> str | None:
    for extra in EXTRAS:
        if req.marker is not None and req.marker.evaluate({"extra": extra}):
            return extra
    return None


def test_production_requirements_are_exactly_the_list() -> None:
    base = {r.name: str(r.specifier) for r in _requirements() if r.marker is None}
    assert base == REQUIRED
    assert not SERVER_ONLY & {r.name for r in _requirements()}


def test_extras_are_exactly_the_list_and_each_installs_something() -> None:
    assert set(metadata.metadata(DIST).get_all("Provides-Extra")) == set(EXTRAS)
    found: dict[str, set[str]] = {extra: set() for extra in EXTRAS}
    for req in _requirements():
        if req.marker is not None:
            found[_extra_of(req)].add(req.name)
    assert found == EXTRAS


def test_one_version_string() -> None:
    assert metadata.version(DIST) == airflow_gpu_resilience.__version__
    assert "versions" not in get_provider_info()  # not a schema key; the metadata's version is the one


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_example_dags_import_only_what_the_package_and_its_examples_extra_declare() -> None:
    """Every module the DAG files import (at parse or at run time) comes from the standard
    library, from the provider's requirements, or from the ``examples`` extra."""
    declared = {"airflow", "airflow_gpu_resilience", "google", "pendulum", "numpy", "sklearn"}
    local = {p.stem for p in (REPO / "dags").glob("*.py")}
    for dag_file in (REPO / "dags").glob("*.py"):
        foreign = _top_level_imports(dag_file) - declared - local - set(sys.stdlib_module_names)
        assert not foreign, f"{dag_file.name} imports {sorted(foreign)}, which no requirement declares"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(REPO)],
                   check=True, capture_output=True, timeout=600)
    [built] = out.glob("airflow_gpu_resilience-*.whl")
    return built


def test_wheel_holds_license_py_typed_and_no_tests_or_dags(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "airflow_gpu_resilience/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert not [n for n in names if n.startswith(("tests/", "dags/", "worker/", "scripts/", "emulator/",
                                                   "cloud_run_emulator/"))]
    assert not [n for n in names if "emulator" in n], "the provider's wheel carries emulator code"
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "License-Expression: Apache-2.0" in text
    assert f"Version: {airflow_gpu_resilience.__version__}\n" in text


def test_the_emulator_is_a_distribution_of_its_own_without_airflow(tmp_path) -> None:
    """``emulator/`` builds a wheel with its console script, its LICENSE and only its package; it
    requires no Airflow and nothing of the provider."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path),
                    str(REPO / "emulator")], check=True, capture_output=True, timeout=600)
    [built] = tmp_path.glob("cloud_run_emulator-*.whl")
    names = zipfile.ZipFile(built).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"cloud_run_emulator"}
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    entry_points = zipfile.ZipFile(built).read(f"{dist_info}/entry_points.txt").decode()
    assert "cloud-run-emulator = cloud_run_emulator.__main__:main" in entry_points
    requires = [Requirement(line.split(":", 1)[1].strip()).name
                for line in zipfile.ZipFile(built).read(f"{dist_info}/METADATA").decode().splitlines()
                if line.startswith("Requires-Dist:")]
    assert "google-cloud-run" in requires and SERVER_ONLY <= set(requires)
    assert not [r for r in requires if r.startswith(("apache-airflow", "airflow"))], requires
    for path in (REPO / "emulator" / "cloud_run_emulator").glob("*.py"):
        assert "airflow" not in _top_level_imports(path) and "airflow_gpu_resilience" not in _top_level_imports(path), path

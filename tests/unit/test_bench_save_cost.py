"""Table tests of the pure parts of ``benchmarks/bench_save_cost.py``: the grid points, the
in-place raw bandwidth and the overhead ratios its tables print."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_save_cost.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_save_cost_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved  # the module puts the repository's folders first; leave the path as it was
    return module


@pytest.mark.parametrize(("spec", "expected"), [
    ("1800:6", (1800, 6, 0)),
    ("256:3:1", (256, 3, 1)),
    ("256:3:0", (256, 3, 0)),
])
def test_grid_points_parse(bench, spec, expected) -> None:
    assert bench.parse_grid_point(spec) == expected


@pytest.mark.parametrize("spec", ["1800", "0:6", "1800:0", "1800:6:-1", "a:6", "1800:6:1:1", ""])
def test_a_bad_grid_point_names_the_option_and_its_form(bench, spec) -> None:
    with pytest.raises(ValueError, match=r"--grid points are SIZE_MIB:EVERY\[:THREADS\]"):
        bench.parse_grid_point(spec)


def _raw(*rates: float) -> dict:
    return {"in_place_bytes_per_s_all": list(rates)}


@pytest.mark.parametrize(("runs", "expected"), [
    ({"none": {}, "sync": {}}, None),  # no raw mode ran
    ({"raw": _raw(1.0, 3.0, 2.0)}, 2.0),  # the median of the runs
    ({"raw-wb": _raw(5.0, 4.0)}, 4.5),
    ({"raw": _raw(1.0, 3.0, 2.0), "raw-wb": _raw(4.0, 6.0, 5.0)}, 5.0),  # the faster mode's median
    ({"raw": _raw(9.0), "raw-wb": _raw(4.0, 6.0, 5.0)}, 9.0),  # whichever is faster
    ({"raw": {}, "raw-wb": _raw(7.0)}, 7.0),  # a raw mode without figures does not count
])
def test_the_in_place_bandwidth_is_the_faster_raw_modes_median(bench, runs, expected) -> None:
    assert bench.in_place_bandwidth(runs) == expected


@pytest.mark.parametrize(("overhead", "written", "probe", "in_place", "expected"), [
    (12.0, 0, 1.0, None, "-"),  # wrote nothing: no ratio
    (12.0, 10, 1.0, None, "1.20"),  # 12 s over 10 bytes at 1 B/s
    (12.0, 10, 1.0, 2.0, "1.20 / 2.40"),  # against the probe / in place
    (-1.0, 10, 1.0, 1.0, "-0.10 / -0.10"),  # faster than no saves: shown as it is
])
def test_ratios(bench, overhead, written, probe, in_place, expected) -> None:
    assert bench._ratios(overhead, written, probe, in_place) == expected


def _run(wall: float, written: int = 0) -> dict:
    return {"wall_s": wall, "bytes_written": written}


@pytest.mark.parametrize(("runs", "expected"), [
    ({"none": _run(10.0), "sync": _run(20.0, 100)}, None),  # no raw mode ran
    ({"raw": _run(20.0, 100)}, None),  # no run without saves to set it against
    ({"none": _run(10.0), "raw": _run(20.0, 100)}, 10.0),  # 100 bytes cost 10 s
    ({"none": _run(10.0), "raw": _run(20.0, 100), "raw-wb": _run(15.0, 100)}, 20.0),  # the cheaper raw mode
    ({"none": _run(10.0), "raw": _run(9.0, 100), "raw-wb": _run(30.0, 100)}, 5.0),  # a free raw run gives none
    ({"none": _run(10.0), "raw": _run(10.0, 100)}, None),  # no cost: no bandwidth
    ({"none": _run(10.0), "raw": _run(20.0, 0)}, None),  # wrote nothing
])
def test_the_raw_run_bandwidth_is_its_bytes_over_its_cost(bench, runs, expected) -> None:
    assert bench.raw_run_bandwidth(runs) == expected


def test_ratios_by_the_raw_runs_cost(bench) -> None:
    # 12 s over no saves for 100 bytes, where a raw writer paid 10 s for them: 1.2 x its cost
    assert bench._ratios(12.0, 100, 100.0, 50.0, 10.0) == "12.00 / 6.00 / 1.20"
    assert bench._ratios(12.0, 100, 100.0, None, 10.0) == "12.00 / - / 1.20"  # each in its place

"""``benchmarks/common.py``'s :func:`merge_rows`: a run that measures some rows of a results file
replaces those and keeps the others, each row dated by the run that measured it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "common.py"
_spec = importlib.util.spec_from_file_location("bench_common_under_test", _PATH)
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def key(row):
    return (row["mode"], row["variant"], row["n"])


def test_a_partial_run_replaces_its_rows_in_place_and_keeps_the_others(tmp_path):
    earlier = {"machine": {"date": "D1", "load_at_start": [12.0], "load_at_end": [24.0]}, "config": {"seed": 1},
               "rows": [{"mode": "deployment", "variant": "new", "n": 100, "block": None},
                        {"mode": "event loop", "variant": "old", "n": 1000, "block": 0.6},
                        {"mode": "event loop", "variant": "new", "n": 1000, "block": 0.104}]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(earlier))
    fresh = [{"mode": "event loop", "variant": "new", "n": 1000, "block": 0.05}]
    rows, runs = common.merge_rows(common.read_report(path), fresh, key, {"date": "D2"})
    assert [(key(r), r["block"], r["run_date"]) for r in rows] == [
        (("deployment", "new", 100), None, "D1"), (("event loop", "old", 1000), 0.6, "D1"),
        (("event loop", "new", 1000), 0.05, "D2")]
    assert runs == [{"date": "D1", "load_at_start": [12.0], "load_at_end": [24.0], "config": {"seed": 1}}]

    path.write_text(json.dumps({"machine": {"date": "D2"}, "rows": rows, "earlier_runs": runs}))
    again, runs_again = common.merge_rows(common.read_report(path), [{"mode": "deployment", "variant": "new", "n": 10}],
                                          key, {"date": "D3"})
    assert [r["run_date"] for r in again] == ["D1", "D1", "D2", "D3"]
    assert [r["date"] for r in runs_again] == ["D1", "D2"]


def test_without_an_earlier_file_only_this_runs_rows_are_written(tmp_path):
    (tmp_path / "list.json").write_text("[]")
    for path in (tmp_path / "missing.json", tmp_path / "list.json"):
        assert common.read_report(path) == {}
        rows, runs = common.merge_rows(common.read_report(path), [{"mode": "m", "variant": "v", "n": 1}], key,
                                       {"date": "D"})
        assert (rows, runs) == ([{"mode": "m", "variant": "v", "n": 1, "run_date": "D"}], [])

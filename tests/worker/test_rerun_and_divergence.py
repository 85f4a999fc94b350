"""Re-runs with changed settings, stale FATAL markers, out-of-range values and divergence.

Each case found by trying to break the worker, driven through ``gpu_resilience_trainer.__main__.main`` in this
process (no process start per case).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpu_resilience_trainer import __main__ as cli

ENV = {"CLOUD_RUN_JOB": "job", "CLOUD_RUN_TASK_INDEX": "0", "CLOUD_RUN_TASK_COUNT": "1"}


def _run(capsys, root: Path, data: Path, *flags: str) -> tuple[int, list[dict]]:
    argv = ["train", "--checkpoint-dir", str(root), "--data", str(data), "--steps", "6",
            "--checkpoint-every", "3", "--sync-save", *flags]
    code = cli.main(argv, dict(ENV))
    return code, [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_a_finished_namespace_refuses_other_settings_instead_of_reporting_the_old_model(
    capsys, tmp_path: Path, digits_npz: Path
) -> None:
    assert _run(capsys, tmp_path, digits_npz)[0] == 0
    metrics_before = (tmp_path / "job" / "task-0" / "metrics.json").read_text()

    code, records = _run(capsys, tmp_path, digits_npz, "--seed", "5")
    errors = [r for r in records if r["severity"] == "ERROR"]
    assert code == 78 and len(errors) == 1
    assert "finished run with other settings" in errors[0]["message"] and "seed" in errors[0]["message"]
    assert (tmp_path / "job" / "task-0" / "metrics.json").read_text() == metrics_before

    # The original settings still find their finished run: the FATAL marker was for --seed 5.
    code, records = _run(capsys, tmp_path, digits_npz)
    assert code == 0
    assert any("ignoring a FATAL marker" in r["message"] for r in records)
    assert any(r["message"] == "run already complete; nothing to do" for r in records)


def test_a_fatal_marker_binds_only_the_invocation_that_failed(capsys, tmp_path: Path, digits_npz: Path) -> None:
    assert _run(capsys, tmp_path, digits_npz, "--batch-size", "0")[0] == 78
    assert (tmp_path / "job" / "task-0" / "FATAL").exists()
    # The same failing invocation exits at once again (a Cloud Run retry of the same task) ...
    code, records = _run(capsys, tmp_path, digits_npz, "--batch-size", "0")
    assert code == 78
    # ... a corrected one trains.
    code, records = _run(capsys, tmp_path, digits_npz)
    assert code == 0 and not (tmp_path / "job" / "task-0" / "FATAL").exists()


@pytest.mark.parametrize(("flag", "value"), [("--seed", "99999999999999999999"),
                                              ("--lr", "inf"), ("--step-delay", "inf")])
def test_out_of_range_values_are_configuration_errors_not_retryable_crashes(
    capsys, tmp_path: Path, digits_npz: Path, flag: str, value: str
) -> None:
    code, records = _run(capsys, tmp_path, digits_npz, flag, value)
    errors = [r for r in records if r["severity"] == "ERROR"]
    assert code == 78 and len(errors) == 1 and flag in errors[0]["message"], errors


def test_a_diverging_run_fails_with_ex_software_instead_of_reporting_success(
    capsys, tmp_path: Path, digits_npz: Path
) -> None:
    with np.load(digits_npz) as arrays:
        data = {k: arrays[k] for k in arrays.files}
    data["x_train"] = data["x_train"] * np.float32(1e38)
    huge = tmp_path / "huge.npz"
    np.savez(huge, **data)
    code, records = _run(capsys, tmp_path / "ckpt", huge)
    errors = [r for r in records if r["severity"] == "ERROR"]
    assert code == 70 and len(errors) == 1 and "diverged" in errors[0]["message"], errors
    assert not (tmp_path / "ckpt" / "job" / "task-0" / "metrics.json").exists()

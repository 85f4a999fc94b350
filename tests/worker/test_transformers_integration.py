"""The documentation's ``transformers.Trainer`` example (``docs/examples/transformers_trainer.py``),
interrupted by SIGTERM and SIGKILL in real processes (``FRAMEWORK_FAULTS_N`` of each, default 10,
during Trainer's own write and before the commit record too), ends with the same weights, bit for
bit, as an uninterrupted run; it never resumes from a torn checkpoint and exits 143 within the grace
period on SIGTERM.

Cost: about 40 s on 2 cores (one fork server importing transformers once; 22 attempts).

Run at torch's default thread count (2 here). Without
:func:`~gpu_resilience_worker.state.settle_vector_math`, which every way in calls before its first
step, it failed there now and then: the example's first oneMKL vector-math call (``torch.tanh`` in GPT-2's ``gelu_new``, on
both intra-op threads) raced with oneMKL's lazy CPU detection, so that in a small share of fresh
processes one thread computed ``tanh`` on another code path, low bits different, and the first
step after a resume differed from the uninterrupted run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import require_module
from tests.worker.frameworks import run_chain

# serial (scripts/run_tests.sh runs it alone): real processes must exit 143 within the grace period after SIGTERM.
pytestmark = pytest.mark.serial


def test_trainer_survives_sigterm_and_sigkill_with_bit_identical_weights(tmp_path: Path) -> None:
    require_module("transformers", extra="transformers")  # a skip; a failure under TESTS_REQUIRE_FULL_ENV=1
    from safetensors.torch import load_file

    baseline, chain, rows = run_chain(
        tmp_path, block="transformers-trainer", folder="out", prefix="checkpoint-", suffix="", max_delay=0.8,
        modules=["transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.trainer",
                 "gpu_resilience_worker.integrations.transformers"])
    assert any(r["skipped_torn"] for r in rows), "no attempt found a torn checkpoint to skip"
    expected = load_file(baseline / "out" / "final" / "model.safetensors")
    got = load_file(chain / "out" / "final" / "model.safetensors")
    assert expected.keys() == got.keys()
    different = [k for k in expected if not (expected[k].dtype == got[k].dtype and expected[k].equal(got[k]))]
    assert not different, f"weights differ from the uninterrupted run: {different}"

"""Bit-exact resume and the torch intra-op thread count.

With ``--hidden 1024`` the CPU matrix products of the MLP split their sums by the number of
intra-op threads (1 and 2 threads give different products), so a run is bit-identical to an
uninterrupted one only if every attempt computes with the same thread count. The default count
comes from the machine and ``OMP_NUM_THREADS``; a retry may get another one. The worker records
the count in each checkpoint and, without ``--threads``, resumes with it; an explicit
``--threads`` that differs is obeyed with a warning, and the hashes then differ.
"""

from __future__ import annotations

import os

import pytest

from tests.worker.conftest import SIGTERM, Task

#: Big enough for the thread count to change the matrix products, short enough for a test.
FLAGS = ("--steps", "30", "--hidden", "1024", "--batch-size", "32", "--seed", "7",
         "--checkpoint-every", "10", "--keep", "3", "--step-delay", "0.05")
TWO = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
ONE = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def hashes(task: Task) -> tuple[str, str]:
    metrics = task.metrics()
    return metrics["model_sha256"], metrics["optimizer_sha256"]


@pytest.fixture(scope="module")
def two_thread_baseline(tmp_path_factory, digits_npz) -> tuple[str, str]:
    """An uninterrupted run whose default thread count is 2."""
    task = Task(root=tmp_path_factory.mktemp("threads-baseline"), data=digits_npz)
    process = task.start(env=TWO, flags=FLAGS)
    assert process.wait(timeout=600) == 0, process.output[-4000:]
    return hashes(task)


def _interrupted_at_two_threads(task: Task) -> None:
    """First attempt with 2 default threads, SIGTERM after its first checkpoint."""
    first = task.start(env=TWO, flags=FLAGS)
    first.wait_for(lambda r: r.get("message") == "checkpoint saved", timeout=300)
    first.signal(SIGTERM)
    assert first.wait(timeout=300) == 143, first.output[-4000:]


def test_resume_on_a_machine_with_another_default_thread_count_is_bit_identical(
        task: Task, two_thread_baseline) -> None:
    """The retry's default is 1 thread (``OMP_NUM_THREADS=1``); it computes with the 2 threads
    recorded in the checkpoint and ends bit-identical to the uninterrupted 2-thread run."""
    _interrupted_at_two_threads(task)
    second = task.start(env=ONE, flags=FLAGS)
    assert second.wait(timeout=600) == 0, second.output[-4000:]
    assert hashes(task) == two_thread_baseline
    assert any(r.get("message", "").startswith("using 2 intra-op threads") for r in second.records), second.output


def test_an_explicit_other_thread_count_warns_and_is_not_bit_identical(task: Task, two_thread_baseline) -> None:
    """``--threads 1`` on the retry is obeyed, with a warning that says the run loses bit-exactness."""
    _interrupted_at_two_threads(task)
    second = task.start("--threads", "1", env=ONE, flags=FLAGS)
    assert second.wait(timeout=600) == 0, second.output[-4000:]
    warnings = [r for r in second.messages("WARNING") if "not be bit-identical" in r.get("message", "")]
    assert warnings and warnings[0]["checkpoint_threads"] == 2 and warnings[0]["threads"] == 1, second.output
    if (os.cpu_count() or 1) >= 2:  # on one core the math library may run 2 requested threads as 1
        assert hashes(task) != two_thread_baseline

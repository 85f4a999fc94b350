"""The teardown's job decision (pure), table-driven: never delete a job under an unended execution."""

from __future__ import annotations

import pytest

from airflow_gpu_resilience.job_cleanup import JobCleanupAction as A
from airflow_gpu_resilience.job_cleanup import JobCleanupResult, decide_job_cleanup

RUNNING = ("projects/p/locations/r/jobs/j/executions/j-abcde",)

CASES = [
    # exists, ours, keep_job, unended, waited, wait -> action
    (False, False, False, (), 0, 120, A.ABSENT),
    (False, True, True, RUNNING, 0, 120, A.ABSENT),
    (True, False, False, (), 0, 120, A.KEEP_NOT_OURS),
    (True, False, True, RUNNING, 500, 120, A.KEEP_NOT_OURS),  # someone else's job: never ours to touch
    (True, True, True, (), 0, 120, A.KEEP_REQUESTED),
    (True, True, True, RUNNING, 0, 120, A.KEEP_REQUESTED),
    (True, True, False, (), 0, 120, A.DELETE),
    (True, True, False, (), 500, 120, A.DELETE),
    (True, True, False, RUNNING, 0, 120, A.WAIT),
    (True, True, False, RUNNING, 119.9, 120, A.WAIT),
    (True, True, False, RUNNING, 120, 120, A.KEEP_RUNNING),
    (True, True, False, RUNNING, 0, 0, A.KEEP_RUNNING),  # no wait asked: keep at once
    (True, True, False, RUNNING * 2, 300, 120, A.KEEP_RUNNING),
]


@pytest.mark.parametrize(("exists", "ours", "keep_job", "unended", "waited", "wait", "expected"), CASES)
def test_decide_job_cleanup(exists, ours, keep_job, unended, waited, wait, expected) -> None:
    assert decide_job_cleanup(exists=exists, ours=ours, keep_job=keep_job, unended_executions=unended,
                              waited_seconds=waited, wait_seconds=wait) is expected


@pytest.mark.parametrize(("waited", "wait"), [(-1, 120), (0, -0.5)])
def test_negative_seconds_are_refused(waited, wait) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        decide_job_cleanup(exists=True, ours=True, keep_job=False, unended_executions=(), waited_seconds=waited,
                           wait_seconds=wait)


def test_result_to_dict_is_json_ready() -> None:
    result = JobCleanupResult(job_name="j", action=A.KEEP_RUNNING, unended_executions=RUNNING, waited_seconds=120.04)
    assert result.to_dict() == {"job_name": "j", "action": "kept: an execution is still running",
                                "unended_executions": list(RUNNING), "waited_seconds": 120.0}

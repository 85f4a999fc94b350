"""An execution whose supervisor fails ends FAILED, with the reason, through the real client.

The failure is a real one: the image table's entry for ``local/bad-env`` has an environment
variable named ``A=B``, which ``subprocess.Popen`` refuses with ``ValueError`` when the first
attempt starts (see ``conftest.py``). Before, the supervisor thread died of it and the
execution stayed RUNNING for ever (its operation never done).
"""

from __future__ import annotations

import pytest
from google.api_core import exceptions as gexc
from google.cloud import run_v2

from .conftest import PARENT, make_job

Cond = run_v2.Condition


def test_an_execution_whose_supervisor_fails_ends_failed_with_the_reason(jobs, executions, tasks, job_id):
    spec = make_job("local/bad-env", task_count=3, parallelism=1)
    job = jobs.create_job(parent=PARENT, job=spec, job_id=job_id).result(timeout=10)
    op = jobs.run_job(name=job.name)
    with pytest.raises(gexc.InternalServerError, match="ValueError: illegal environment variable name"):
        op.result(timeout=30)
    execution = executions.get_execution(name=op.metadata.name)
    completed = {c.type_: c for c in execution.conditions}["Completed"]
    assert completed.state == Cond.State.CONDITION_FAILED and completed.reason == Cond.CommonReason.INTERNAL
    assert "illegal environment variable name" in completed.message and execution.completion_time
    assert (execution.running_count, execution.failed_count, execution.cancelled_count) == (0, 1, 2)
    listed = list(tasks.list_tasks(parent=execution.name))
    assert all(t.completion_time and not t.reconciling for t in listed)
    assert "illegal environment variable name" in listed[0].last_attempt_result.status.message

"""The emulator's bound on task processes running at once holds over a 10,000-task execution.

An execution of 10,000 tasks at ``parallelism`` 10,000 on an emulator started with
``--max-task-processes 4``: it succeeds, the emulator never has more than 4 task processes (its
own peak counter, and its children sampled with psutil while it runs), and its memory grows by
far less than 200 MB (Task records, not threads or processes). Before the bound, such an
execution started processes for every task it could claim, all at once (a 10,001-task run
exhausted a machine's memory). Not timed: every assertion is a count or a size.
"""

from __future__ import annotations

import time

import psutil
from google.auth.credentials import AnonymousCredentials
from google.cloud import run_v2

from cloud_run_emulator.process import EmulatorProcess

from .conftest import PARENT, make_job

TASKS, BOUND = 10_000, 4


def _run(jobs, executions, job_name: str, emulator_proc: psutil.Process, known: set) -> tuple:
    """Run the job; return ``(execution, most task processes seen at once)``, sampling the
    emulator's children (other than ``known``) every 50 ms and the execution every second."""
    name, most, samples = jobs.run_job(name=job_name).metadata.name, 0, 0
    while True:
        children = [c.pid for c in emulator_proc.children() if c.pid not in known]
        most, samples = max(most, len(children)), samples + 1
        if samples % 20 == 0 and (execution := executions.get_execution(name=name)).completion_time:
            return execution, most
        time.sleep(0.05)


def test_10000_tasks_run_with_at_most_the_bound_of_processes_and_flat_memory(tmp_path, images_file):
    with EmulatorProcess(tmp_path / "emu", images_file=images_file, max_task_processes=BOUND) as emu:
        opts = {"credentials": AnonymousCredentials(), "transport": "rest",
                "client_options": {"api_endpoint": emu.endpoint}}
        jobs, executions = run_v2.JobsClient(**opts), run_v2.ExecutionsClient(**opts)
        proc = psutil.Process(emu.pid)
        known = {c.pid for c in proc.children()}
        warm = jobs.create_job(parent=PARENT, job=make_job("local/true", task_count=50, parallelism=50),
                               job_id="warm-up").result(timeout=10)
        _run(jobs, executions, warm.name, proc, known)  # first-use allocations are not growth
        rss_before = proc.memory_info().rss
        spec = make_job("local/true", task_count=TASKS, parallelism=TASKS, max_retries=0)
        job = jobs.create_job(parent=PARENT, job=spec, job_id="many").result(timeout=10)
        execution, most = _run(jobs, executions, job.name, proc, known)
        growth = proc.memory_info().rss - rss_before
        counted = emu.task_processes()
    assert (execution.succeeded_count, execution.failed_count, execution.running_count) == (TASKS, 0, 0)
    assert counted == {"limit": BOUND, "running": 0, "peak": BOUND}
    assert 0 < most <= BOUND
    assert growth < 200 * 2**20, f"the emulator grew by {growth / 2**20:.0f} MiB"

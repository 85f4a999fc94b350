"""The emulator process lifecycle: ready line, CLI preempt, and no children left after stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from google.auth.credentials import AnonymousCredentials
from google.cloud import run_v2

from airflow_gpu_resilience.emulator.process import EmulatorProcess
from airflow_gpu_resilience.emulator.runtime import default_max_task_processes

from .conftest import PARENT, make_job, task_name


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_stop_kills_running_task_processes(tmp_path, images_file):
    with EmulatorProcess(tmp_path / "emu", images_file=images_file, grace_seconds=1.0) as emu:
        opts = {"api_endpoint": emu.endpoint}
        jobs = run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest", client_options=opts)
        tasks = run_v2.TasksClient(credentials=AnonymousCredentials(), transport="rest", client_options=opts)
        jobs.create_job(parent=PARENT, job=make_job("local/stubborn", task_count=2), job_id="stop").result()
        op = jobs.run_job(name=f"{PARENT}/jobs/stop")
        answer = subprocess.run(
            [sys.executable, "-m", "airflow_gpu_resilience.emulator", "preempt", "--endpoint", emu.endpoint,
             "--execution", op.metadata.name, "--task-index", "1", "--grace-seconds", "30"],
            capture_output=True, text=True, timeout=30, check=True)
        pid = json.loads(answer.stdout)["pid"]
        assert _pid_alive(pid)  # SIGTERM is ignored; SIGKILL is 30 s away
        deadline = time.monotonic() + 10
        while tasks.get_task(name=task_name(op.metadata.name, 0)).start_time is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert len(emu.children) >= 2
    assert not any(_pid_alive(c.pid) for c in emu.children)
    assert not _pid_alive(pid)
    assert not _pid_alive(emu.pid)


@pytest.mark.serial  # a start-up time bound (the ready line within 5 s)
def test_serve_prints_one_ready_line_fast(tmp_path):
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "airflow_gpu_resilience.emulator", "serve", "--port", "0", "--gcs-port", "0",
         "--data-dir", str(tmp_path)], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        ready = json.loads(proc.stdout.readline())
        assert time.monotonic() - started < 5  # < 2 s on an idle machine; CI is busier
        assert ready["ready"] and ready["endpoint"].startswith("http://127.0.0.1:")
        assert ready["gcsEndpoint"].startswith("http://127.0.0.1:")
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_hard_killed_emulator_takes_its_task_processes_along(tmp_path, images_file):
    with EmulatorProcess(tmp_path / "emu", images_file=images_file) as emu:
        opts = {"api_endpoint": emu.endpoint}
        jobs = run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest", client_options=opts)
        jobs.create_job(parent=PARENT, job=make_job("local/stubborn"), job_id="hard").result()
        op = jobs.run_job(name=f"{PARENT}/jobs/hard")
        pid = emu.preempt(op.metadata.name, 0, grace_seconds=60)["pid"]
        os.kill(emu.pid, 9)
        deadline = time.monotonic() + 5
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _pid_alive(pid)


def test_serve_flags_start_a_seeded_preemption_schedule(monkeypatch, tmp_path):
    from airflow_gpu_resilience.emulator import __main__ as cli, server

    seen = []
    monkeypatch.setattr(server, "serve", seen.append)
    argv = ["serve", "--data-dir", str(tmp_path), "--preempt-every", "30", "--preempt-seed", "4",
            "--preempt-prefix", "projects/p/locations/l/jobs/train"]
    assert cli.main(argv) == 0
    plan = seen[0].preemptions
    assert (plan.mean_seconds, plan.seed, plan.name_prefix) == (30.0, 4, "projects/p/locations/l/jobs/train")
    assert cli.main(["serve", "--data-dir", str(tmp_path)]) == 0 and seen[1].preemptions is None
    assert seen[1].policy.max_task_processes == default_max_task_processes()
    assert cli.main(["serve", "--data-dir", str(tmp_path), "--max-task-processes", "12"]) == 0
    assert seen[2].policy.max_task_processes == 12


@pytest.mark.parametrize("flags, named", [
    (["--grace-seconds", "-1"], "--grace-seconds"), (["--grace-seconds", "nan"], "--grace-seconds"),
    (["--task-start-delay", "-5"], "--task-start-delay"), (["--gpu-quota", "-1"], "--gpu-quota"),
    (["--preempt-every", "-3"], "--preempt-every"), (["--preempt-every", "inf"], "--preempt-every"),
    (["--failed-execution-code", "99"], "--failed-execution-code"),
    (["--max-task-processes", "0"], "--max-task-processes"),
])
def test_serve_refuses_out_of_range_flags_before_it_starts(tmp_path, flags, named):
    """A user's bad flag is one usage error naming it and the allowed values (exit 2), not an
    emulator that starts and then never SIGKILLs a preempted task or never runs one."""
    result = subprocess.run([sys.executable, "-m", "airflow_gpu_resilience.emulator", "serve", "--port", "0",
                             "--gcs-port", "0", "--data-dir", str(tmp_path / "emu"), *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert named in result.stderr and "ready" not in result.stdout, result.stderr
    assert not (tmp_path / "emu").exists()

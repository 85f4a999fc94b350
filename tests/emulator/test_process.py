"""The emulator process lifecycle: ready line, CLI preempt, and no children left after stop."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

from google.auth.credentials import AnonymousCredentials
from google.cloud import run_v2

from cloud_run_emulator.process import EmulatorProcess
from cloud_run_emulator.runtime import default_max_task_processes

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
            [sys.executable, "-m", "cloud_run_emulator", "preempt", "--endpoint", emu.endpoint,
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
        [sys.executable, "-m", "cloud_run_emulator", "serve", "--port", "0", "--gcs-port", "0",
         "--data-dir", str(tmp_path)], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        ready = json.loads(proc.stdout.readline())
        assert time.monotonic() - started < 5  # < 2 s on an idle machine; CI is busier
        assert ready["ready"] and ready["endpoint"].startswith("http://127.0.0.1:")
        assert ready["gcsEndpoint"].startswith("http://127.0.0.1:")
        # the variables a plain client reads (see emulator/README.md)
        assert ready["env"] == {"CLOUD_RUN_EMULATOR_HOST": ready["grpcEndpoint"],
                                "STORAGE_EMULATOR_HOST": ready["gcsEndpoint"]}
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


# Ignores SIGTERM, says "started", sleeps RUN_FOR seconds (default 20), then writes the file MARKER:
# a marker means that the process ran to its end, which an attempt of a hard-killed emulator must not.
HOLDOUT_SCRIPT = (
    "import os,signal,time\nsignal.signal(signal.SIGTERM,signal.SIG_IGN)\nprint('started',flush=True)\n"
    "time.sleep(float(os.environ.get('RUN_FOR','20')))\nopen(os.environ['MARKER'],'w').write('ran to its end')\n"
)


def _wait_for(condition, what: str, limit: float = 60.0) -> None:
    """Poll ``condition()`` until it is true; fail naming ``what`` after ``limit`` s (a guard
    against a hang, far beyond the time it takes)."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {limit:g} s"
        time.sleep(0.02)


def _wait_for_exit(pid: int) -> None:
    """Block until process ``pid`` (not a child of this one) has ended, through a pidfd."""
    fd = os.pidfd_open(pid)
    try:
        readable, _, _ = select.select([fd], [], [], 90.0)  # the holdout ends by itself after 20 s
        assert readable, f"process {pid} is still running"
    finally:
        os.close(fd)


# Starts the holdout as its own child (the task's child process, in the attempt's process group),
# writes that child's pid to the file GRANDCHILD, then waits.
PARENT_SCRIPT = (
    "import os,subprocess,sys,time\nchild=subprocess.Popen([sys.executable,'-c',os.environ['HOLDOUT']])\n"
    "open(os.environ['GRANDCHILD']+'.tmp','w').write(str(child.pid))\n"
    "os.rename(os.environ['GRANDCHILD']+'.tmp',os.environ['GRANDCHILD'])\ntime.sleep(60)\n"
)


@pytest.fixture
def holdout(tmp_path, monkeypatch):
    """``(images file with 'local/holdout' and 'local/holdout-parent', marker path)``; the marker
    path is in every task's env."""
    images = tmp_path / "holdout-images.json"
    images.write_text(json.dumps({"images": {"local/holdout": {"entrypoint": ["{python}", "-c", HOLDOUT_SCRIPT]},
                                             "local/holdout-parent": {"entrypoint": ["{python}", "-c", PARENT_SCRIPT]}}}))
    monkeypatch.setenv("HOLDOUT", HOLDOUT_SCRIPT)
    marker = tmp_path / "ran-to-its-end"
    monkeypatch.setenv("MARKER", str(marker))
    return images, marker


def _jobs(emu):
    return run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest",
                             client_options={"api_endpoint": emu.endpoint})


def test_hard_killed_emulator_takes_its_task_processes_along(tmp_path, holdout):
    """A running attempt that ignores SIGTERM (preempted, SIGKILL 60 s away) dies with a
    SIGKILLed emulator: it never runs to its end."""
    images, marker = holdout
    with EmulatorProcess(tmp_path / "emu", images_file=images) as emu:
        _jobs(emu).create_job(parent=PARENT, job=make_job("local/holdout", max_retries=0), job_id="hard").result()
        execution = _jobs(emu).run_job(name=f"{PARENT}/jobs/hard").metadata.name
        log = emu.data_dir / "logs" / execution.rsplit("/", 1)[-1] / "task0-attempt0.log"
        # SIGTERM ignored from here on: the preemption below cannot be what ends it
        _wait_for(lambda: log.exists() and "started" in log.read_text(), "the attempt's start")
        pid = emu.preempt(execution, 0, grace_seconds=60)["pid"]
        os.kill(emu.pid, signal.SIGKILL)
        _wait_for_exit(pid)
    assert not marker.exists(), "the attempt outlived the hard-killed emulator"


def test_hard_killed_emulator_takes_the_task_processes_own_children_along(tmp_path, holdout, monkeypatch):
    """A task's own child process (its grandchild to the emulator, in the attempt's process group,
    ignoring SIGTERM) dies with a SIGKILLed emulator too, as all of a container's processes end
    with it: it never runs to its end. The parent-death signal alone ends only the attempt's
    first process; the child then ran on as init's."""
    images, marker = holdout
    grandchild = tmp_path / "grandchild-pid"
    monkeypatch.setenv("GRANDCHILD", str(grandchild))
    with EmulatorProcess(tmp_path / "emu", images_file=images) as emu:
        _jobs(emu).create_job(parent=PARENT, job=make_job("local/holdout-parent", max_retries=0), job_id="kin").result()
        _jobs(emu).run_job(name=f"{PARENT}/jobs/kin")
        _wait_for(grandchild.exists, "the task's child process")
        pid = int(grandchild.read_text())
        os.kill(emu.pid, signal.SIGKILL)
        _wait_for_exit(pid)
    assert not marker.exists(), "the task's own child outlived the hard-killed emulator"


def test_attempt_being_started_when_the_emulator_is_hard_killed_dies_too(tmp_path, holdout, monkeypatch):
    """An attempt whose parent-death signal is not set yet when the emulator is SIGKILLed (a
    retry being started, on a busy machine) dies all the same. A stand-in ``setpriv`` first on
    PATH holds the new process before the real one runs (as a scheduler that has not run it
    yet) until the emulator is dead; the old code's attempt then ran on as init's child."""
    real = shutil.which("setpriv")
    if real is None:
        pytest.skip("no util-linux setpriv: attempts set their death signal in a preexec_fn")
    images, marker = holdout
    hold = tmp_path / "hold"
    (hold / "bin").mkdir(parents=True)
    stand_in = hold / "bin" / "setpriv"
    stand_in.write_text(f'''#!/bin/sh
echo $$ > "{hold}/pid.tmp" && mv "{hold}/pid.tmp" "{hold}/pid"
while [ ! -e "{hold}/go" ]; do sleep 0.01; done
exec {real} "$@"
''')
    stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stand_in.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("RUN_FOR", "0")
    pidfd = None
    try:
        with EmulatorProcess(tmp_path / "emu", images_file=images) as emu:
            _jobs(emu).create_job(parent=PARENT, job=make_job("local/holdout", max_retries=0), job_id="held").result()
            _jobs(emu).run_job(name=f"{PARENT}/jobs/held")
            _wait_for(lambda: (hold / "pid").exists(), "the attempt's spawn")
            pidfd = os.pidfd_open(int((hold / "pid").read_text()))
            os.kill(emu.pid, signal.SIGKILL)
            _wait_for(lambda: not _pid_alive(emu.pid), "the emulator's death")  # a zombie: every thread gone
            (hold / "go").touch()
            readable, _, _ = select.select([pidfd], [], [], 90.0)
            assert readable, "the held attempt is still running"
    finally:
        (hold / "go").touch()
        if pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
    assert not marker.exists(), "an attempt being started when the emulator was hard-killed ran on"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_preexec_fallback_ends_a_child_whose_parent_is_not_the_emulator_any_more():
    """Without setpriv the child sets its death signal in a preexec_fn, then checks that its
    parent is still the emulator (here: a pid that is not its parent, as after the emulator's
    death); the check fails, the child kills itself before exec."""
    from cloud_run_emulator.runtime import _die_with_emulator

    def run(emulator_pid):
        return subprocess.run([sys.executable, "-c", "pass"], timeout=60,
                              preexec_fn=functools.partial(_die_with_emulator, emulator_pid)).returncode

    assert run(os.getpid()) == 0
    assert run(os.getppid()) == -signal.SIGKILL


def test_serve_flags_start_a_seeded_preemption_schedule(monkeypatch, tmp_path):
    from cloud_run_emulator import __main__ as cli, server

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
    result = subprocess.run([sys.executable, "-m", "cloud_run_emulator", "serve", "--port", "0",
                             "--gcs-port", "0", "--data-dir", str(tmp_path / "emu"), *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert named in result.stderr and "ready" not in result.stdout, result.stderr
    assert not (tmp_path / "emu").exists()

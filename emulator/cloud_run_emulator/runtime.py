"""Task attempts as local child processes: what one attempt runs, with which environment, where
its output goes, and how its end becomes a ``TaskAttemptResult``.

:func:`launch` starts one attempt in its own process group (``start_new_session=True``) with the
container's argv from the :mod:`.images` table, its env plus ``CLOUD_RUN_JOB``,
``CLOUD_RUN_EXECUTION``, ``CLOUD_RUN_TASK_INDEX``, ``CLOUD_RUN_TASK_ATTEMPT`` (0-based) and
``CLOUD_RUN_TASK_COUNT``. stdout and stderr go to
``{data_dir}/logs/{execution}/task{i}-attempt{n}.log``. Each attempt gets the parent-death signal
SIGKILL (through ``setpriv --pdeathsig KILL`` when util-linux has it, which keeps ``subprocess``
on its vfork path; else with a ``preexec_fn``), so attempts die with a hard-killed emulator, also
one being started at that moment (see :func:`_spawn_args`), and the processes an attempt
started die with them (its process group, see :mod:`.group_reaper`).
:class:`Attempt` is one running attempt: it signals its process group (:meth:`Attempt.stop`:
SIGTERM now, SIGKILL due after the grace) and translates its return code and stop reason
(:meth:`Attempt.result`). :class:`RuntimePolicy` holds the settings (grace, pacing, retries).

When attempts start, are reaped, time out, are retried or end the execution is decided by the
execution's :class:`~.supervisor.ExecutionSupervisor`, not here.

Known differences from Cloud Run:

- No container isolation: the process inherits the emulator's environment (PATH, HOME, ...)
  under the image table's and the container's env.
- GCS volumes: processes cannot see ``/checkpoints``, so every env value, arg and command
  element equal to a mount path or starting with ``mountPath + "/"`` (also after ``--flag=``)
  is rewritten to the bucket's local directory (honouring ``subPath``); a rewritten path never
  leaves that directory (validation refuses such jobs, :func:`rewrite` refuses them again).
  With FUSE available that directory is the bucket's FUSE mount (see :mod:`.gcsfuse`).
- Only the first container runs; sidecars, probes, secrets (``valueSource``) are ignored.
- ``workingDir`` maps to a local folder (:func:`working_dir`); a relative or missing one fails
  the attempt's start.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import ctypes.util
import dataclasses
import functools
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from google.cloud import run_v2

from .group_reaper import GROUPS
from .guards import PathEscape, climbs_out, contained, under_mount
from .images import ImageEntry, ImageTable
from .models import PREEMPTION_MESSAGE, AttemptResult, Task, utcnow


def _load_prctl():
    """``prctl`` from libc on Linux, else ``None`` (loaded once, before any fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1
#: util-linux ``setpriv``: sets the parent-death signal and execs the command. Spawning through
#: it keeps ``subprocess`` on its fast vfork path (a ``preexec_fn`` forces a full fork of the
#: emulator plus Python code in the child: about 4x slower per attempt).
_SETPRIV = shutil.which("setpriv") if _PRCTL is not None and os.access("/bin/sh", os.X_OK) else None
#: Run by ``/bin/sh`` between ``setpriv`` and the attempt's command, as ``sh -c SCRIPT sh
#: EMULATOR_PID ARGV...``: the death signal set, the attempt goes on only while its parent is still
#: the emulator (the shell reads ``$PPID`` at its start, after ``setpriv``'s ``prctl``). The shell
#: sets ``PWD`` to the attempt's folder, which the command then inherits.
_STILL_PARENT = '[ "$PPID" = "$1" ] || { kill -KILL $$; exit 137; }; shift; exec "$@"'


def _die_with_emulator(emulator_pid: int) -> None:
    """Child-side, before exec: SIGKILL this process if the emulator dies (even by SIGKILL), or
    has died already (see :func:`_spawn_args`).

    Linux only; elsewhere a hard-killed emulator can leave attempts behind.

    :param emulator_pid: the emulator's pid, taken before the fork.
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != emulator_pid:
            os.kill(os.getpid(), signal.SIGKILL)


def _spawn_args(argv: list, cwd: Path, env: dict) -> tuple:
    """``(argv, preexec_fn)`` that make the attempt die with the emulator: through ``setpriv
    --pdeathsig KILL`` then ``/bin/sh`` (:data:`_STILL_PARENT`) when ``setpriv`` exists, else
    with a ``preexec_fn``.

    The death signal is set in the child, after ``Popen`` has returned (``setpriv``) or at least
    after the fork, and ``PR_SET_PDEATHSIG`` in a child whose parent has died already sets
    nothing (``prctl(2)``): the child belongs to init (or a subreaper) by then. An emulator hard-killed in
    that moment (say, while it retries a preempted attempt) would leave the attempt running for
    good. So after the ``prctl`` the child checks that its parent is still the emulator, and
    kills itself if not; from then on the signal covers the emulator's death.

    :raises FileNotFoundError: when ``argv[0]`` is not an executable (as ``Popen`` would).
    """
    if _SETPRIV is None:
        return argv, functools.partial(_die_with_emulator, os.getpid())
    program = argv[0] if argv else ""
    found = (os.access(Path(cwd, program), os.X_OK) if os.sep in program
             else shutil.which(program, path=env.get("PATH", os.defpath)) is not None)
    if not found:
        raise FileNotFoundError(f"No such executable: '{program}'")
    return [_SETPRIV, "--pdeathsig", "KILL", "--", "/bin/sh", "-c", _STILL_PARENT, "sh", str(os.getpid()),
            *argv], None


@dataclasses.dataclass
class RuntimePolicy:
    """How attempts are run and paced; changeable at run time (``/_emulator/transitions``).

    :param grace_seconds: SIGTERM-to-SIGKILL grace for timeouts, preemption and cancel (s,
        default 10).
    :param poll_seconds: supervisor loop period (s).
    :param failed_execution_code: gRPC code on the RunJob LRO error of a failed execution
        (default 9, FAILED_PRECONDITION; the real code is unconfirmed).
    :param start_delay_seconds: delay before each attempt starts, like a GPU instance start (s,
        default 0).
    :param preemption_consumes_retry: whether a preempted attempt counts against
        ``maxRetries`` (default true; undocumented for Cloud Run, so configurable).
    :param gpu_quota: GPU attempts that may run at once per project and location; further GPU
        tasks wait as pending (0, the default: unlimited). The real quota semantics are
        inferred: Cloud Run's behaviour when the quota is exceeded is not documented.
    :param max_task_processes: task attempts running at once on this machine, across every
        execution of the emulator; further tasks wait as pending, as beyond ``parallelism``
        (default :func:`default_max_task_processes`). Cloud Run runs each task on an instance of
        its own; here they share one machine, so the bound is the emulator's, not Cloud Run's.
    """

    grace_seconds: float = 10.0
    poll_seconds: float = 0.05
    failed_execution_code: int = 9
    start_delay_seconds: float = 0.0
    preemption_consumes_retry: bool = True
    gpu_quota: int = 0
    max_task_processes: int = dataclasses.field(default_factory=lambda: default_max_task_processes())


def default_max_task_processes() -> int:
    """The default bound on task processes at once: 8.

    A task here is a whole training process (a PyTorch worker takes hundreds of MB), not a
    container on a machine of its own, so the bound stays small whatever the job asks for: an
    execution of 10,000 tasks with ``parallelism`` 0 must not start 10,000 processes. It does not
    follow the CPU count: several DAG runs training at once (the local Airflow stack runs five) each
    need their task running, and a waiting process costs memory, not CPU; 8 such workers fit a
    laptop's memory. Waiting tasks cost nothing; raise it with ``serve --max-task-processes``.
    """
    return 8


class ProcessSlots:
    """How many task processes run (or are being started) on this machine, over all executions.

    Not locked itself: the supervisors take and give slots holding the registry's lock. A slot
    is taken when a pending task is claimed, before its process is spawned, and given back once
    its process is reaped (or could not be started), so the bound holds for processes alive.
    """

    def __init__(self) -> None:
        self.in_use = 0
        self.peak = 0

    def free(self, limit: int) -> int:
        """Slots free under ``limit`` (0 when the bound was lowered below the processes running)."""
        return max(0, limit - self.in_use)

    def take(self) -> None:
        self.in_use += 1
        self.peak = max(self.peak, self.in_use)

    def give(self, count: int = 1) -> None:
        self.in_use -= count

    def describe(self, limit: int) -> dict:
        """``{"limit", "running", "peak"}`` (``/_emulator/health``'s ``taskProcesses``)."""
        return {"limit": limit, "running": self.in_use, "peak": self.peak}


#: The :class:`RuntimePolicy` settings a user sets (``serve`` flags, ``/_emulator/transitions``):
#: attribute -> (kind, lowest, highest allowed value).
POLICY_LIMITS = {
    "grace_seconds": ("float", 0.0, 3600.0),
    "start_delay_seconds": ("float", 0.0, 3600.0),
    "gpu_quota": ("int", 0, 1_000_000),
    "failed_execution_code": ("int", 1, 16),
    "max_task_processes": ("int", 1, 10_000),
}


def policy_value(attr: str, value: object) -> float | int:
    """A checked value for the :class:`RuntimePolicy` setting ``attr`` (see :data:`POLICY_LIMITS`).

    :raises ValueError: a value of another type, not finite, or out of range; the message gives
        the allowed values.
    """
    kind, low, high = POLICY_LIMITS[attr]
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"must be an integer from {low} to {high}, got {value!r}")
        return value
    try:
        number = float("nan") if isinstance(value, bool) else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = float("nan")
    if not (math.isfinite(number) and low <= number <= high):
        raise ValueError(f"must be a number of seconds from {low:g} to {high:g}, got {value!r}")
    return number


@dataclasses.dataclass
class RuntimeConfig:
    """What the supervisors share.

    :param data_dir: emulator data directory (logs under ``logs/``).
    :param images: image table.
    :param gcs: the :class:`~.gcs.GcsService` backing GCS volumes.
    :param policy: pacing and retry settings.
    :param mounts: the :class:`~.gcsfuse.VolumeMounts` that serve GCS volumes (FUSE mounts, or
        the bucket folders); ``None``: bucket folders (a ``VolumeMounts`` in ``folder`` mode).
    :param slots: the task processes running on this machine (bounded by
        ``policy.max_task_processes``).
    """

    data_dir: Path
    images: ImageTable
    gcs: object
    policy: RuntimePolicy = dataclasses.field(default_factory=RuntimePolicy)
    mounts: Optional[object] = None
    slots: ProcessSlots = dataclasses.field(default_factory=ProcessSlots)

    def __post_init__(self) -> None:
        if self.mounts is None:
            from .gcsfuse import VolumeMounts

            self.mounts = VolumeMounts(self.data_dir, self.gcs.bucket_dir, mode="folder")


def mount_map(template: run_v2.TaskTemplate, mounts) -> list:
    """``[(mount_path, local_dir)]`` for the first container's GCS volume mounts: the folder
    ``mounts`` (a :class:`~.gcsfuse.VolumeMounts`) serves for the bucket with the volume's
    ``mountOptions`` (its FUSE mount, or the bucket's folder; the ``only-dir`` folder of either).

    :raises PathEscape: when a ``subPath`` leads out of its bucket's folder (validation refuses
        such a job first; this is the last line).
    """
    volumes = {v.name: v.gcs for v in template.volumes if v.gcs.bucket}
    pairs = []
    for mount in template.containers[0].volume_mounts if template.containers else []:
        if mount.name in volumes:
            volume = volumes[mount.name]
            local = mounts.local_dir(volume.bucket, list(volume.mount_options))
            pairs.append((mount.mount_path.rstrip("/") or "/", contained(local, mount.sub_path) if mount.sub_path else local))
    return pairs


def rewrite(value: str, mounts: list) -> str:
    """Map a container path under a mount path to its local directory; other values unchanged.

    :raises PathEscape: when the path would lead out of the mount's folder (``/checkpoints/../x``;
        validation refuses such a job first).
    """
    for mount_path, local in mounts:
        split = under_mount(value, mount_path)
        if split is not None:
            head, rest = split
            if climbs_out(rest):
                raise PathEscape(f"'{value}' leads out of the volume mounted at {mount_path}.")
            contained(local, rest.lstrip("/"))
            return head + str(local) + rest
    return value


def uses_gpu(template: run_v2.TaskTemplate) -> bool:
    """Whether a container of the template requests ``nvidia.com/gpu``."""
    return any("nvidia.com/gpu" in c.resources.limits for c in template.containers)


def gcs_buckets(template: run_v2.TaskTemplate) -> list:
    """Names of the buckets the template mounts."""
    return [v.gcs.bucket for v in template.volumes if v.gcs.bucket]


@dataclasses.dataclass
class Attempt:
    """One running attempt of a task."""

    task: Task
    number: int
    popen: subprocess.Popen
    log_path: Path
    deadline: float  # monotonic time the task timeout expires
    stop_reason: Optional[str] = None  # "preempted" | "timeout" | "cancelled"
    kill_at: Optional[float] = None  # monotonic time SIGKILL is due
    started: dt.datetime = dataclasses.field(default_factory=utcnow)
    pidfd: Optional[int] = None  # readable once the process has exited (Linux), see wait_for_exit

    def __post_init__(self) -> None:
        try:
            self.pidfd = os.pidfd_open(self.popen.pid)
        except (AttributeError, OSError):  # not Linux >= 5.3, or the process is gone already
            self.pidfd = None

    def close(self) -> None:
        """Release the process descriptor and the group's watch (after the group was SIGKILLed
        and the process reaped)."""
        GROUPS.forget(self.popen.pid)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the attempt's process group, ignoring a group already gone."""
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, reason: str, grace: float) -> None:
        """SIGTERM now, SIGKILL after ``grace`` seconds (enforced by the supervisor loop)."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self.kill_at = time.monotonic() + grace
            self.signal_group(signal.SIGTERM)

    def result(self, returncode: int) -> AttemptResult:
        """Translate the return code (and why it was stopped) into a ``TaskAttemptResult``."""
        code = {"exit_code": returncode} if returncode >= 0 else {"term_signal": -returncode}
        if returncode == 0:
            return AttemptResult(0, "", **code)
        if self.stop_reason == "preempted":
            return AttemptResult(14, PREEMPTION_MESSAGE, **code)
        if self.stop_reason == "timeout":
            return AttemptResult(4, f"Task {self.task.name} exceeded its timeout of {self.task.timeout_s:g}s.", **code)
        if self.stop_reason == "cancelled":
            return AttemptResult(1, "The task was cancelled.", **code)
        if returncode < 0:
            return AttemptResult(2, f"The container was terminated by signal {-returncode}.", **code)
        return AttemptResult(2, "The container exited with an error.", **code)


def wait_for_exit(attempts: list, timeout: float) -> None:
    """Block until a process of ``attempts`` exits, or ``timeout`` seconds pass (just the
    timeout when there is none, or one has no process descriptor), so that a supervisor reaps
    an attempt and starts the next at once instead of at its next poll.

    :param attempts: running :class:`Attempt` objects.
    :param timeout: the longest wait (s).
    """
    fds = [a.pidfd for a in attempts]
    if not fds or None in fds:
        time.sleep(timeout)
        return
    poller = select.poll()  # not select(): no limit on descriptor numbers
    for fd in fds:
        poller.register(fd, select.POLLIN)
    poller.poll(timeout * 1000)  # a descriptor closed meanwhile (shutdown) answers at once: looked at again


def task_env(task: Task, attempt: int, task_count: int, entry: ImageEntry, mounts: list) -> dict:
    """Environment of one attempt: emulator env < image env < container env < CLOUD_RUN_*."""
    env = dict(os.environ)
    env.update(entry.env)
    for var in task.template.containers[0].env:
        if "value" in var:
            env[var.name] = rewrite(var.value, mounts)
    env.update({
        "CLOUD_RUN_JOB": task.job,
        "CLOUD_RUN_EXECUTION": task.execution,
        "CLOUD_RUN_TASK_INDEX": str(task.index),
        "CLOUD_RUN_TASK_ATTEMPT": str(attempt),
        "CLOUD_RUN_TASK_COUNT": str(task_count),
    })
    return env


def working_dir(path: str, entry: ImageEntry, mounts: list) -> Path:
    """The local folder an attempt runs in for a container's ``workingDir``.

    - unset: the image entry's ``cwd`` (the image's own working directory);
    - under a GCS volume's mount path: that folder of the bucket (as env values and args are);
    - at or below the entry's ``workdir`` (the container path its ``cwd`` plays): ``cwd`` or that
      folder of it;
    - any other absolute path: that folder of this machine (there is no container file system).

    :param path: the container's ``workingDir``.
    :param entry: the image's table entry.
    :param mounts: ``[(mount_path, local_dir)]`` from :func:`mount_map`.
    :raises OSError: when ``path`` is relative (a container runtime refuses a relative working
        directory: the container does not start) or the folder does not exist (Docker would
        create it inside the container; the emulator creates no folder on this machine): the
        attempt fails to start, visibly, and is retried like any failed start.
    """
    if not path:
        return entry.cwd
    if not path.startswith("/"):
        raise OSError(f"workingDir '{path}' is not an absolute path")
    local = rewrite(path, mounts)
    if local == path and entry.workdir:
        split = under_mount(path, entry.workdir.rstrip("/"))  # "/" plays the whole path
        if split is not None:
            local = str(contained(entry.cwd, split[1].lstrip("/")))
    if not Path(local).is_dir():
        shown = path if local == path else f"{path}' (here '{local}"
        raise OSError(f"workingDir '{shown}' is not an existing folder")
    return Path(local)


def launch(task: Task, attempt: int, task_count: int, config: RuntimeConfig) -> Attempt:
    """Start one attempt; raises ``LookupError`` for an image not in the table, ``OSError``
    when the command cannot be started."""
    container = task.template.containers[0]
    entry = config.images.resolve(container.image)
    if entry is None:
        raise LookupError(f"Image '{container.image}' is not in the emulator's image table.")
    try:
        mounts = mount_map(task.template, config.mounts)
    except (RuntimeError, ValueError) as exc:
        raise OSError(f"the cloud-storage volume could not be mounted: {exc}") from exc
    argv = [rewrite(a, mounts) for a in entry.argv(list(container.command), list(container.args))]
    log_dir = Path(config.data_dir, "logs", task.execution)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"task{task.index}-attempt{attempt}.log"
    env = task_env(task, attempt, task_count, entry, mounts)
    cwd = working_dir(container.working_dir, entry, mounts)
    argv, preexec = _spawn_args(argv, cwd, env)
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=preexec)
    GROUPS.watch(popen.pid)  # the group, the task's own child processes included, ends with the emulator
    return Attempt(task, attempt, popen, log_path, time.monotonic() + task.timeout_s)

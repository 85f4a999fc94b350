"""The main job on one machine: the example DAG against the local Cloud Run and GCS emulators.

``make demo`` runs this script. It

1. starts the Cloud Run emulator (with its embedded GCS emulator) on free loopback ports,
2. runs ``airflow dags test gpu_resilient_training`` against them, with a throwaway
   ``AIRFLOW_HOME`` and a ``google_cloud_platform`` connection whose extra ``api_endpoint``
   points at the emulator,
3. injects maintenance preemptions (SIGTERM, grace period, SIGKILL) into the running training
   task through the emulator's admin endpoint, once the worker has made progress,
4. prints a report (DAG run state, executions, attempts, preemptions, the step each resume
   started from, work lost, held-out accuracy) and writes it as JSON,
5. stops every process it started, also on Ctrl-C, SIGTERM or failure.

Exit status: 0 when the DAG run succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))  # demo_report, also when this file is loaded by path

from google.api_core.client_options import ClientOptions  # noqa: E402
from google.auth.credentials import AnonymousCredentials  # noqa: E402
from google.cloud import run_v2  # noqa: E402

from cloud_run_emulator import process as emulator_process  # noqa: E402
from cloud_run_emulator.process import EmulatorProcess  # noqa: E402
from demo_report import build_summary, goodput_report, logging_requests, print_report  # noqa: E402

DAG_ID = "gpu_resilient_training"
PROJECT = "local-project"
REGION = "us-central1"
JOB = "gpu-resilient-training"
BUCKET = "gpu-resilient-checkpoints"

OFFLINE_ENV = {**emulator_process.OFFLINE_ENV, "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}


class Interrupted(Exception):
    """Raised in the main thread when the demo receives SIGTERM, so that cleanup runs."""


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--checkpoint-every", type=int, default=50,
                        help="steps between checkpoints (default: %(default)s)")
    parser.add_argument("--step-delay", type=float, default=0.03,
                        help="seconds of delay per step (default: %(default)s)")
    parser.add_argument("--preemptions", type=int, default=2,
                        help="maintenance preemptions to inject; every 2nd lands inside a checkpoint write "
                             "(default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=1024,
                        help="hidden units, a bigger model makes a longer write (default: %(default)s)")
    parser.add_argument("--preemption-save", choices=["deadline", "always", "never"], default="deadline",
                        help="the worker's checkpoint at a SIGTERM; 'never' makes each preemption cost the "
                             "steps since the last checkpoint (wasted progress) (default: %(default)s)")
    parser.add_argument("--log-container-output", action="store_true",
                        help="copy the job's Cloud Logging lines into the Airflow task log (the emulator "
                             "serves entries:list)")
    parser.add_argument("--seed", type=int, default=0, help="training seed (default: %(default)s)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the uninterrupted reference run that checks the final model bit for bit "
                             "(by default it runs)")
    parser.add_argument("--grace-seconds", type=float, default=10.0,
                        help="SIGTERM-to-SIGKILL grace in seconds (default: %(default)s)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where state and logs go (default: a new folder under demo-output/)")
    parser.add_argument("--report", type=Path, default=None,
                        help="where the JSON report goes (default: report.json in the workdir)")
    args = parser.parse_args(argv)
    problem = demo_args_problem(args)
    if problem:
        parser.error(problem)
    return args


def demo_args_problem(args: argparse.Namespace) -> str | None:
    """The first bad value among the demo's arguments, as one message naming the option and its
    allowed values; ``None`` when all are good. Checked before anything starts or is written
    (``--workdir`` is created here, as the demo would, and must be writable).

    :param args: the parsed arguments.
    """
    if args.steps < 1:
        return f"--steps must be at least 1, got {args.steps}"
    if args.checkpoint_every < 1:
        return f"--checkpoint-every must be at least 1, got {args.checkpoint_every}"
    if args.step_delay < 0:
        return f"--step-delay must be 0 or more seconds, got {args.step_delay:g}"
    if args.hidden < 1:
        return f"--hidden must be at least 1, got {args.hidden}"
    if not args.grace_seconds > 0:
        return f"--grace-seconds must be more than 0 (Cloud Run gives 10), got {args.grace_seconds:g}"
    most = max(0, args.steps // args.checkpoint_every - 1)
    if not 0 <= args.preemptions <= most:
        return (f"--preemptions must be in 0..{most} (each lands in its own checkpoint interval of "
                f"--steps {args.steps} / --checkpoint-every {args.checkpoint_every}, one left after the last), "
                f"got {args.preemptions}")
    if args.workdir is not None:
        try:
            args.workdir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=args.workdir):
                pass
        except OSError as exc:
            return f"--workdir {args.workdir} is not a writable folder: {exc.strerror or exc}"
    return None


def airflow_env(workdir: Path, emulator: EmulatorProcess) -> dict[str, str]:
    """:return: the environment for Airflow commands against ``emulator``, state under ``workdir``."""
    connection = {
        "conn_type": "google_cloud_platform",
        "extra": {"project": PROJECT, "is_anonymous": True, "api_endpoint": emulator.endpoint},
    }
    env = dict(os.environ)
    env.update(OFFLINE_ENV)
    env.update(
        {
            "AIRFLOW_HOME": str(workdir / "airflow-home"),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT": json.dumps(connection),
            "STORAGE_EMULATOR_HOST": emulator.gcs_endpoint,
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def task_folder(job_folder: Path, index: int = 0) -> Path | None:
    """:return: ``{job}/{run namespace}/task-{index}`` of the one DAG run in the bucket, if any."""
    found = sorted(job_folder.glob(f"*/task-{index}"))
    return found[0] if found else None


def _run_client(emulator: EmulatorProcess, client_class):
    return client_class(
        credentials=AnonymousCredentials(),
        transport="rest",
        client_options=ClientOptions(api_endpoint=emulator.endpoint),
    )


_CKPT_RE = re.compile(r"^ckpt-(\d{8,})\.(pt|commit\.json)$")


class Preempter(threading.Thread):
    """Injects maintenance preemptions into task 0 of the running execution.

    Preemption ``k`` (1-based) of ``count`` waits until ``progress.json`` reports at least
    ``k / (count + 1)`` of the total steps, so every preemption hits real, unsaved work. Every
    second one (the 2nd, 4th, ...) then also waits until the worker has started writing a
    checkpoint (its data file exists, its commit record does not yet) and lands inside that
    write. Each one is recorded with the attempt result that the Cloud Run API then reports.
    """

    def __init__(self, emulator: EmulatorProcess, count: int, total_steps: int) -> None:
        super().__init__(name="preempter", daemon=True)
        self.emulator, self.count, self.total_steps = emulator, count, total_steps
        self.records: list[dict] = []
        self.error: str | None = None
        self.stop = threading.Event()
        self.jobs = _run_client(emulator, run_v2.JobsClient)
        self.tasks = _run_client(emulator, run_v2.TasksClient)
        self.job_folder = emulator.bucket_dir(BUCKET) / JOB

    @property
    def namespace(self) -> Path:
        """Task 0's checkpoint folder (the DAG run's namespace is named after its run id)."""
        return task_folder(self.job_folder) or self.job_folder / "-" / "task-0"

    def run(self) -> None:
        try:
            for k in range(1, self.count + 1):
                if not self._wait_for_progress(self.total_steps * k // (self.count + 1)):
                    return
                target = self._find_target()  # looked up first: once a write starts, only the POST remains
                writing = self._wait_for_checkpoint_write() if k % 2 == 0 else None
                if k % 2 == 0 and writing is None:
                    return
                self._preempt(target, writing)
        except Exception as exc:  # reported in the summary; the DAG still decides success
            self.error = f"{type(exc).__name__}: {exc}"

    def _progress_step(self) -> int:
        try:
            return int(json.loads((self.namespace / "progress.json").read_text())["step"])
        except (OSError, ValueError, KeyError):
            return -1

    def _wait_for_progress(self, step: int) -> bool:
        while self._progress_step() < step:
            if self.stop.wait(0.05):
                return False
        return True

    def _listed_folder(self) -> Path:
        """Task 0's folder as the worker sees it: on a FUSE volume only the mount lists files still
        being written (the bucket gets them at close)."""
        if getattr(self, "_mount", None) is None:
            found = self.emulator.volume_dir(BUCKET)
            self._mount = found / JOB if found != self.emulator.bucket_dir(BUCKET) else None
        return self.namespace if self._mount is None else self._mount / self.namespace.relative_to(self.job_folder)

    def _checkpoint_files(self) -> tuple[set[int], set[int]]:
        data, commits = set(), set()
        try:
            names = os.listdir(self._listed_folder())
        except OSError:
            return data, commits
        for name in names:
            match = _CKPT_RE.match(name)
            if match:
                (data if match.group(2) == "pt" else commits).add(int(match.group(1)))
        return data, commits

    def _wait_for_checkpoint_write(self) -> int | None:
        """:return: the step of a checkpoint whose data is being written, polled every 1 ms, never
        the last step's (a SIGTERM in the final write would find the work done, not preempt it);
        None once the run has ended without one."""
        floor = max(self._checkpoint_files()[1], default=-1)
        while not self.stop.is_set():
            data, commits = self._checkpoint_files()
            writing = [step for step in data - commits if floor < step < self.total_steps]
            if writing:
                return max(writing)
            time.sleep(0.001)
        return None

    def _find_target(self) -> tuple[str, str, int]:
        """:return: the running execution, its task 0, and that task's retry count so far."""
        execution = self.jobs.get_job(name=f"projects/{PROJECT}/locations/{REGION}/jobs/{JOB}")
        execution_name = execution.latest_created_execution.name
        task_name = next(t.name for t in self.tasks.list_tasks(parent=execution_name) if t.index == 0)
        return execution_name, task_name, self.tasks.get_task(name=task_name).retried

    def _preempt(self, target: tuple[str, str, int], writing: int | None) -> None:
        execution_name, task_name, before = target
        at_step, sent_at = self._progress_step(), time.time()
        answer = self.emulator.preempt(execution_name, task_index=0)
        # the report says whether it landed inside that write (the commit record came after it)
        where = (f"aimed at the write of checkpoint step {writing} (data file seen, no commit record yet)"
                 if writing is not None else f"at step {at_step}")
        print(f"[demo] maintenance preemption injected {where}: {json.dumps(answer)}", flush=True)
        self.records.append({"execution": execution_name, "task_index": 0, "injected_at_step": at_step,
                             "checkpoint_being_written": writing})
        self._record_result(task_name, before)
        if writing is not None:
            self.records[-1]["landed_during_write"] = self._landed_during_write(writing, sent_at)

    def _landed_during_write(self, step: int, sent_at: float) -> bool:
        """Whether that checkpoint's commit record came after the SIGTERM (or never came)."""
        commit = self.namespace / f"ckpt-{step:08d}.commit.json"
        try:
            return commit.stat().st_mtime >= sent_at
        except OSError:
            return True

    def _record_result(self, task_name: str, retried_before: int) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not self.stop.is_set():
            task = self.tasks.get_task(name=task_name)
            if task.retried > retried_before or task.completion_time:
                result = task.last_attempt_result
                self.records[-1].update(
                    attempt=retried_before,
                    exit_code=result.exit_code if "exit_code" in result else None,
                    term_signal=result.term_signal if "term_signal" in result else None,
                    message=result.status.message,
                )
                return
            time.sleep(0.1)


def run_dag(env: dict[str, str], conf: dict, log_path: Path, dag_id: str = DAG_ID,
            logical_date: str | None = None) -> int:
    """Migrate the Airflow DB, then ``airflow dags test`` one DAG; :return: its exit status.

    The DAG run's process group is killed if this is interrupted.
    """
    airflow = str(Path(sys.executable).with_name("airflow"))
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [airflow, "dags", "test", dag_id, *([logical_date] if logical_date else []), "--conf", json.dumps(conf)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            return process.wait()
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _worker_args(args: argparse.Namespace) -> list[str]:
    """The training flags the DAG passes, for the uninterrupted reference run."""
    return ["--steps", str(args.steps), "--checkpoint-every", str(args.checkpoint_every),
            "--hidden", str(args.hidden), "--seed", str(args.seed), "--preemption-save", args.preemption_save]


def _reference_run(workdir: Path, dataset: Path, args: argparse.Namespace) -> dict:
    """Train the same model, same seed, uninterrupted, outside Cloud Run; :return: its metrics."""
    root = workdir / "reference"
    (root / "data").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(dataset, root / "data" / "digits.npz")
    env = {**os.environ, "CLOUD_RUN_JOB": JOB, "PYTHONPATH": os.pathsep.join([str(REPO / "worker"), str(REPO)])}
    with (workdir / "reference-run.log").open("w") as log:
        subprocess.run([sys.executable, "-m", "gpu_resilience_trainer", "train", "--checkpoint-dir", str(root), *_worker_args(args)],
                       cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=900)
    return json.loads((root / JOB / "task-0" / "metrics.json").read_text())


def main(argv: list[str] | None = None) -> int:
    """Run the demo; :return: 0 when the DAG run succeeded (and matched the reference), else 1."""
    args = _parse_args(argv)
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="demo-", dir=REPO / "demo-output"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)

    def _on_sigterm(signum, frame):
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, _on_sigterm)
    log_path = workdir / "airflow-dags-test.log"
    conf = {"steps": args.steps, "checkpoint_every": args.checkpoint_every, "step_delay_seconds": args.step_delay,
            "hidden_units": args.hidden, "seed": args.seed, "poll_interval_seconds": 2.0,
            "preemption_save": args.preemption_save, "log_container_output": args.log_container_output}
    with EmulatorProcess(
        data_dir=workdir / "emulator", images_file=REPO / "worker" / "emulator-image.json",
        grace_seconds=args.grace_seconds,
    ) as emulator:
        print(f"[demo] Cloud Run emulator at {emulator.endpoint}, GCS emulator at {emulator.gcs_endpoint}")
        preempter = Preempter(emulator, args.preemptions, args.steps)
        preempter.start()
        try:
            rc = run_dag(airflow_env(workdir, emulator), conf, log_path)
        finally:
            preempter.stop.set()
            preempter.join(timeout=30)
        dataset = emulator.bucket_dir(BUCKET) / "data" / "digits.npz"
        reference = _reference_run(workdir, dataset, args) if args.verify and rc == 0 else None
        summary = build_summary(emulator, DAG_ID, task_folder(emulator.bucket_dir(BUCKET) / JOB), rc, preempter,
                                reference, goodput_report(workdir, emulator) if rc == 0 else None)
        summary["logging_requests"] = logging_requests(emulator)
    print_report(summary, log_path)
    report_path = args.report or workdir / "report.json"
    report_path.write_text(json.dumps(summary, indent=2))
    print(f"[demo] report written to {report_path}")
    injected = len(summary["preemptions"]) == args.preemptions and not summary["preempter_error"]
    if not injected:
        print(f"[demo] only {len(summary['preemptions'])} of {args.preemptions} preemptions were injected",
              file=sys.stderr)
    return 0 if rc == 0 and injected and summary["identical_to_uninterrupted_run"] is not False else 1


if __name__ == "__main__":
    (REPO / "demo-output").mkdir(exist_ok=True)
    try:
        sys.exit(main())
    except (KeyboardInterrupt, Interrupted) as exc:
        print(f"[demo] interrupted ({exc or type(exc).__name__}); every process it started has been stopped",
              file=sys.stderr)
        sys.exit(130)

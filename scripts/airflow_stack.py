"""A real Airflow deployment on one machine: PostgreSQL, scheduler, DAG processor, triggerer,
API server (with the UI) and the Cloud Run + GCS emulators, on loopback, in a throwaway folder.

``make stack`` runs this script: it starts everything, prints the UI's address and login, and
keeps running until Ctrl-C (or SIGTERM), then stops every process it started. The deployment
tests (``tests/deployment/``) start the same stack through :class:`AirflowStack`.

What it starts, in order, each in its own process group, each waited for until healthy:

1. PostgreSQL from the operating system's packages (``initdb`` and ``postgres`` from
   ``/usr/lib/postgresql/<version>/bin``, or ``$PG_BIN``): a fresh cluster with a database
   ``airflow`` owned by the role ``airflow`` (trust authentication, listening on 127.0.0.1
   only). Run as root, PostgreSQL runs as the unprivileged ``postgres`` OS user (it refuses
   root).
2. The Cloud Run emulator with its embedded GCS emulator (``python -m
   cloud_run_emulator serve``; the worker image maps to ``python -m gpu_resilience_trainer``
   through ``worker/emulator-image.json``).
3. ``airflow db migrate`` on that database, then ``airflow api-server``, ``scheduler`` (with
   ``LocalExecutor``), ``dag-processor`` and ``triggerer`` as four processes, with ``dags/`` as
   the DAGs folder. Healthy means: the API server answers ``/api/v2/monitor/health`` and that
   answer reports the metadatabase, scheduler, DAG processor and triggerer healthy (their
   heartbeats in the database).
4. The ``google_cloud_default`` connection (type ``google_cloud_platform``, extra
   ``api_endpoint`` = the emulator), created through the REST API as a user would.

Every port is a free one chosen at start-up; nothing listens on anything but 127.0.0.1 (the
scheduler's and triggerer's log servers are off: the API server reads task logs from the
shared log folder). Login: SimpleAuthManager, user ``admin``, password ``admin`` (from a
passwords file in the folder; ``--password`` changes it). The REST API takes a JWT from
``POST /auth/token``; :meth:`AirflowStack.api_client` returns an authenticated
``apache-airflow-client`` client.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from cloud_run_emulator.process import OFFLINE_ENV, EmulatorProcess  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, also when loaded from a file path
from stack_processes import StackError, _http_json, _Proc, find_pg_bin, free_port  # noqa: E402

#: The Airflow processes the stack runs, in start order.
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
#: ``/api/v2/monitor/health`` keys that must say ``healthy`` (the metadatabase, and the jobs'
#: heartbeats) before the stack counts as started.
HEALTH_KEYS = ("metadatabase", "scheduler", "dag_processor", "triggerer")
USERNAME = "admin"
DEFAULT_PASSWORD = "admin"
PROJECT = "local-project"
CONN_ID = "google_cloud_default"
#: Settings (``airflow_config``) for a stack driven by a test or a benchmark rather than a person:
#: the scheduler and the jobs' heartbeats every 2 s instead of 5 s, so that a deferred task's
#: event or a freed slot is acted on within seconds.
FAST_HEARTBEATS = {
    "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
    "AIRFLOW__SCHEDULER__JOB_HEARTBEAT_SEC": "2",
    "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
}


class AirflowStack:
    """The whole deployment as a context manager (see the module docstring).

    :param workdir: throwaway folder for every part's state and logs (created; kept afterwards
        so that logs can be read, the caller removes it).
    :param dags_folder: the DAGs folder (default: the repository's ``dags/``).
    :param grace_seconds: the emulator's SIGTERM-to-SIGKILL grace in seconds (default 10).
    :param password: the ``admin`` user's password (default ``admin``).
    :param airflow_config: more ``AIRFLOW__SECTION__KEY`` settings for every Airflow process.
    :param start_timeout: seconds to wait for each part to become healthy (default 240).
    :param log: where progress lines go (default: print to stderr).
    :raises StackError: from :meth:`start` when a part does not start; everything already
        started is stopped first.
    """

    def __init__(self, workdir: Path, dags_folder: Optional[Path] = None, grace_seconds: float = 10.0,
                 password: str = DEFAULT_PASSWORD, airflow_config: Optional[dict] = None,
                 start_timeout: float = 240.0, log: Optional[Callable[[str], None]] = None) -> None:
        if not password:
            raise ValueError("password: must be a non-empty string")
        if grace_seconds < 0:
            raise ValueError(f"grace_seconds: must be >= 0, got {grace_seconds}")
        self.workdir = Path(workdir).resolve()
        self.dags_folder = Path(dags_folder or REPO / "dags").resolve()
        self.grace_seconds, self.password = grace_seconds, password
        self.airflow_config = dict(airflow_config or {})
        self.start_timeout = start_timeout
        self._log = log or (lambda line: print(f"[stack] {line}", file=sys.stderr, flush=True))
        self.procs: dict[str, _Proc] = {}
        self.emulator: Optional[EmulatorProcess] = None
        self.pg_port = self.api_port = 0
        self.pg_data: Optional[Path] = None
        self.env: dict[str, str] = {}
        self.timings: dict[str, float] = {}
        self._token: Optional[str] = None

    # ----------------------------------------------------------------------------- life cycle
    def __enter__(self) -> "AirflowStack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def api_url(self) -> str:
        """The API server (and UI) base address, e.g. ``http://127.0.0.1:41234``."""
        return f"http://127.0.0.1:{self.api_port}"

    def start(self) -> None:
        """Start every part and wait until each is healthy (see the module docstring)."""
        begin = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        self._start_postgres()
        self.timings["postgres_s"] = round(time.monotonic() - begin, 1)
        mark = time.monotonic()
        self.emulator = EmulatorProcess(self.workdir / "emulator", images_file=REPO / "worker" / "emulator-image.json",
                                        grace_seconds=self.grace_seconds).__enter__()
        self._log(f"Cloud Run emulator at {self.emulator.endpoint}, GCS emulator at {self.emulator.gcs_endpoint}")
        self.timings["emulator_s"] = round(time.monotonic() - mark, 1)
        mark = time.monotonic()
        self.env = self._airflow_env()
        self._airflow(["db", "migrate"], "db-migrate")
        self.timings["db_migrate_s"] = round(time.monotonic() - mark, 1)
        mark = time.monotonic()
        for name in COMPONENTS:
            self.start_component(name)
        self.wait_healthy()
        self.timings["airflow_healthy_s"] = round(time.monotonic() - mark, 1)
        self.create_connection()
        self.timings["total_s"] = round(time.monotonic() - begin, 1)
        self._log(f"stack ready in {self.timings['total_s']} s: UI {self.api_url} (login {USERNAME} / "
                  f"{self.password}), state and logs in {self.workdir}")

    def stop(self) -> None:
        """Stop every process the stack started (Airflow, emulator, PostgreSQL); idempotent."""
        for name in reversed(list(self.procs)):
            self.procs[name].stop()
        if self.emulator is not None:
            try:
                self.emulator.stop()
            except RuntimeError as exc:  # a worker outlived the emulator: say so, keep stopping
                self._log(f"emulator stop: {exc}")
            self.emulator = None
        self._stop_postgres()
        self.procs.clear()

    # ----------------------------------------------------------------------------- PostgreSQL
    def _pg_user(self) -> Optional[str]:
        """PostgreSQL refuses to run as root: as root, run it as the ``postgres`` OS user."""
        if os.geteuid() != 0:
            return None
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise StackError("running as root, but there is no `postgres` OS user to run PostgreSQL as "
                             "(the postgresql package creates it)") from None
        return "postgres"

    def _start_postgres(self) -> None:
        pg_bin = find_pg_bin()
        user = self._pg_user()
        # A folder of its own that the postgres user owns (the workdir may be private to root).
        self.pg_data = Path(tempfile.mkdtemp(prefix="agr-pg-"))
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(self.pg_data, entry.pw_uid, entry.pw_gid)
        cluster = self.pg_data / "data"
        log_path = self.workdir / "logs" / "postgres.log"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
        initdb = _Proc("initdb", [str(pg_bin / "initdb"), "-D", str(cluster), "-U", "airflow", "--auth=trust",
                                  "-E", "UTF8", "--no-sync"], env, log_path, user=user, cwd=self.pg_data)
        if initdb.popen.wait(timeout=180) != 0:
            raise StackError(f"initdb failed (exit {initdb.popen.returncode}); see {log_path}:\n{initdb.tail()}")
        self.pg_port = free_port()
        self.procs["postgres"] = _Proc(
            "postgres",
            [str(pg_bin / "postgres"), "-D", str(cluster), "-p", str(self.pg_port), "-c", "listen_addresses=127.0.0.1",
             "-c", f"unix_socket_directories={self.pg_data}", "-c", "fsync=off", "-c", "max_connections=200"],
            env, log_path, user=user, cwd=self.pg_data)
        createdb = [str(pg_bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.pg_port), "-U", "airflow", "airflow"]
        deadline = time.monotonic() + self.start_timeout
        while True:
            if not self.procs["postgres"].alive():
                raise StackError(f"postgres exited; see {log_path}:\n{self.procs['postgres'].tail()}")
            done = subprocess.run(createdb, env=env, capture_output=True, text=True)
            if done.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise StackError(f"PostgreSQL did not accept connections: {done.stderr.strip()}; see {log_path}")
            time.sleep(0.3)
        self._log(f"PostgreSQL on 127.0.0.1:{self.pg_port}, database airflow")

    def _stop_postgres(self) -> None:
        if self.pg_data is not None:
            shutil.rmtree(self.pg_data, ignore_errors=True)
            self.pg_data = None

    # ----------------------------------------------------------------------------- Airflow
    def _airflow_env(self) -> dict[str, str]:
        from cryptography.fernet import Fernet

        self.api_port = free_port()
        home = self.workdir / "airflow-home"
        home.mkdir(exist_ok=True)
        passwords = self.workdir / "simple_auth_manager_passwords.json"
        passwords.write_text(json.dumps({USERNAME: self.password}))
        env = dict(os.environ)
        env.update(OFFLINE_ENV)
        env.update({
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__FERNET_KEY": Fernet.generate_key().decode(),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"postgresql+psycopg2://airflow@127.0.0.1:{self.pg_port}/airflow",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.api_url}/execution/",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.api_port),
            "AIRFLOW__API__BASE_URL": self.api_url,
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "AIRFLOW__CORE__AUTH_MANAGER":
                "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USERNAME}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "STORAGE_EMULATOR_HOST": self.emulator.gcs_endpoint,
            "PYTHONUNBUFFERED": "1",
        })
        env.update({key: str(value) for key, value in self.airflow_config.items()})
        for key in [k for k in env if k.startswith("AIRFLOW_CONN_")]:
            del env[key]  # the connection comes from the REST API, as a user's would
        return env

    def _airflow(self, args: list[str], log_name: str, timeout: float = 600) -> None:
        airflow = str(Path(sys.executable).with_name("airflow"))
        log_path = self.workdir / "logs" / f"{log_name}.log"
        with log_path.open("ab") as log:
            done = subprocess.run([airflow, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=timeout, start_new_session=True)
        if done.returncode != 0:
            raise StackError(f"`airflow {' '.join(args)}` failed (exit {done.returncode}); see {log_path}")

    def start_component(self, name: str, extra_env: Optional[dict] = None) -> None:
        """Start one Airflow process (``api-server``, ``scheduler``, ``dag-processor``, ``triggerer``).

        :param name: one of :data:`COMPONENTS`.
        :param extra_env: more environment for this process only (default none).
        :raises ValueError: another name, or that component is already running.
        """
        if name not in COMPONENTS:
            raise ValueError(f"name: must be one of {COMPONENTS}, got {name!r}")
        if name in self.procs and self.procs[name].alive():
            raise ValueError(f"name: {name} is already running (pid {self.procs[name].pid})")
        argv = [str(Path(sys.executable).with_name("airflow")), name]
        if name in ("scheduler", "triggerer"):
            argv.append("--skip-serve-logs")  # no log server on 0.0.0.0; the API server reads the files
        self.procs[name] = _Proc(name, argv, {**self.env, **(extra_env or {})},
                                 self.workdir / "logs" / f"{name}.log")
        self._log(f"started {name} (pid {self.procs[name].pid})")

    def kill_component(self, name: str, signum: int = signal.SIGKILL, timeout: float = 60.0) -> None:
        """Send ``signum`` to a component's process group and wait until its leader has ended.

        With ``SIGKILL`` nothing of it runs any clean-up (a crash); with ``SIGTERM`` it shuts down
        as on a deploy. Whatever of its group is left after ``timeout`` s is SIGKILLed.

        :param name: one of the running :data:`COMPONENTS`.
        :raises ValueError: that component is not running.
        """
        proc = self.procs.get(name)
        if proc is None or not proc.alive():
            raise ValueError(f"name: {name!r} is not running")
        proc.signal(signum)
        try:
            proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        proc.signal(signal.SIGKILL)
        proc.popen.wait(timeout=10)
        self._log(f"{name} ended after signal {signum} (exit {proc.popen.returncode})")

    def health(self) -> dict:
        """:return: ``/api/v2/monitor/health`` (no login needed), ``{}`` while it does not answer."""
        try:
            return _http_json(f"{self.api_url}/api/v2/monitor/health")
        except (OSError, ValueError):
            return {}

    def wait_healthy(self, keys=HEALTH_KEYS, timeout: Optional[float] = None) -> dict:
        """Wait until every component in ``keys`` reports ``healthy``; :return: the health answer.

        :raises StackError: a process exited, or ``timeout`` (default ``start_timeout``) passed.
        """
        deadline = time.monotonic() + (timeout or self.start_timeout)
        answer: dict = {}
        while time.monotonic() < deadline:
            for proc in self.procs.values():
                if not proc.alive():
                    raise StackError(f"{proc.name} exited (code {proc.popen.returncode}); see {proc.log_path}:\n"
                                     f"{proc.tail()}")
            answer = self.health()
            if answer and all(answer.get(k, {}).get("status") == "healthy" for k in keys):
                return answer
            time.sleep(0.5)
        raise StackError(f"not healthy after {timeout or self.start_timeout} s: {answer}; logs in {self.workdir / 'logs'}")

    # ----------------------------------------------------------------------------- REST API
    def token(self, refresh: bool = False) -> str:
        """:return: a JWT for the ``admin`` user from ``POST /auth/token``."""
        if self._token is None or refresh:
            answer = _http_json(f"{self.api_url}/auth/token", {"username": USERNAME, "password": self.password},
                                timeout=30)
            self._token = answer["access_token"]
        return self._token

    def api_client(self):
        """:return: an ``airflow_client.client.ApiClient`` for this stack, logged in as ``admin``."""
        import airflow_client.client as client

        configuration = client.Configuration(host=self.api_url, access_token=self.token())
        return client.ApiClient(configuration)

    def create_connection(self) -> None:
        """Create ``google_cloud_default`` (type ``google_cloud_platform``) through the REST API,
        anonymous credentials, extra ``api_endpoint`` = the Cloud Run emulator."""
        import airflow_client.client as client

        extra = {"project": PROJECT, "is_anonymous": True, "api_endpoint": self.emulator.endpoint}
        with self.api_client() as api:
            client.ConnectionApi(api).post_connection(client.ConnectionBody(
                connection_id=CONN_ID, conn_type="google_cloud_platform", extra=json.dumps(extra)))
        self._log(f"connection {CONN_ID} created through the REST API (api_endpoint {self.emulator.endpoint})")


def main(argv: Optional[list[str]] = None) -> int:
    """``make stack``: start the stack, print how to reach it, run until Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None,
                        help="state and logs (default: a new folder under stack-output/)")
    parser.add_argument("--password", default=DEFAULT_PASSWORD, help="the admin user's password (default: admin)")
    parser.add_argument("--grace-seconds", type=float, default=10.0,
                        help="the emulator's SIGTERM-to-SIGKILL grace (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.workdir is None:
        (REPO / "stack-output").mkdir(exist_ok=True)
        args.workdir = Path(tempfile.mkdtemp(prefix="stack-", dir=REPO / "stack-output"))

    stopping = False

    def _on_signal(signum, frame):
        """The first SIGINT/SIGTERM stops the stack; later ones must not cut that stop short (make
        passes a SIGTERM sent to its process group on to this script, which then gets it twice;
        an impatient second Ctrl-C does the same)."""
        nonlocal stopping
        if stopping:
            print(f"[stack] {signal.Signals(signum).name}: already stopping every process it started",
                  file=sys.stderr, flush=True)
            return
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        with AirflowStack(args.workdir, grace_seconds=args.grace_seconds, password=args.password) as stack:
            print(f"\nAirflow UI:        {stack.api_url}   (user {USERNAME}, password {args.password})\n"
                  f"REST API:          {stack.api_url}/api/v2   (JWT from POST {stack.api_url}/auth/token)\n"
                  f"Cloud Run emulator: {stack.emulator.endpoint}   GCS emulator: {stack.emulator.gcs_endpoint}\n"
                  f"logs:              {stack.workdir / 'logs'}\n"
                  f"Trigger gpu_resilient_training from the UI (unpause it first). Ctrl-C stops everything.",
                  flush=True)
            while True:
                for proc in stack.procs.values():
                    if not proc.alive():
                        print(f"[stack] {proc.name} exited (code {proc.popen.returncode}); stopping",
                              file=sys.stderr)
                        return 1
                time.sleep(1)
    except KeyboardInterrupt:
        print("[stack] stopped; every process it started has ended", file=sys.stderr)
        return 0
    except StackError as exc:
        print(f"[stack] {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

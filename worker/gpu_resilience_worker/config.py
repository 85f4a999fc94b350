"""The Cloud Run environment of a task: who it is (:class:`TaskIdentity`), when it must stop (:class:`StopTiming`)
and where its checkpoint folder is (:func:`task_namespace`); a malformed variable is a
:class:`~gpu_resilience_worker.errors.ConfigError` (exit 78)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

from gpu_resilience_worker.errors import ConfigError, check_number
from gpu_resilience_worker.preemption import DEFAULT_GRACE_SECONDS, PreemptionWatcher, set_task_deadline

#: The checkpoint root when neither the caller nor ``CHECKPOINT_DIR`` names one (the mounted bucket).
DEFAULT_ROOT = "/checkpoints"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: The largest number of seconds a duration variable may say: Cloud Run's longest task timeout
#: (168 hours). Beyond it a wait overflows the platform's timestamps (``inf``, ``1e300``).
MAX_SECONDS = 604800.0


def _env_number(env: Mapping[str, str], name: str, default: float | None, *, integer: bool = False,
                minimum: float = 0, strict: bool = False) -> float | None:
    """:return: the variable ``name`` as an int (``integer``) or a number of seconds in [``minimum``,
    :data:`MAX_SECONDS`] (above ``minimum`` when ``strict``), ``default`` when unset or empty.
    :raises ConfigError: naming the variable, its value and the range."""
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not {'an integer' if integer else 'a number'}") from None
    if integer and value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    if not integer and not ((value > minimum if strict else value >= minimum) and value <= MAX_SECONDS):
        raise ConfigError(f"{name}={raw!r} must be a number of seconds {'>' if strict else '>='} {minimum:g} "
                          f"and <= {MAX_SECONDS:g}")  # also refuses nan
    return value


@dataclasses.dataclass(frozen=True)
class StopTiming:
    """The grace period and the attempt's timeout: the one parse of ``PREEMPTION_GRACE_SECONDS`` and
    ``TASK_TIMEOUT_SECONDS`` (the worker <-> platform contract), for every way in.

    :param grace_seconds: SIGTERM to SIGKILL, seconds; default 10.
    :param task_timeout_seconds: the attempt's timeout, seconds, from the process's start; ``None``: no deadline."""

    grace_seconds: float = DEFAULT_GRACE_SECONDS
    task_timeout_seconds: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, grace_seconds: float | None = None,
                 task_timeout_seconds: float | None = None) -> StopTiming:
        """A value given here wins over the environment's.

        :param env: the environment; default ``os.environ``.
        :param grace_seconds: the grace period, when the caller fixes it (checked by :meth:`check`).
        :param task_timeout_seconds: the timeout, when the caller fixes it (checked by :meth:`check`).
        :raises ConfigError: ``PREEMPTION_GRACE_SECONDS`` not a number of seconds in [0, :data:`MAX_SECONDS`],
            or ``TASK_TIMEOUT_SECONDS`` set but not in (0, :data:`MAX_SECONDS`]."""
        env = os.environ if env is None else env
        grace = _env_number(env, "PREEMPTION_GRACE_SECONDS", DEFAULT_GRACE_SECONDS) if grace_seconds is None \
            else grace_seconds
        timeout = _env_number(env, "TASK_TIMEOUT_SECONDS", None, strict=True) if task_timeout_seconds is None \
            else task_timeout_seconds
        return cls(float(grace), None if timeout is None else float(timeout))

    @staticmethod
    def check(grace_seconds: float | None = None, task_timeout_seconds: float | None = None) -> None:
        """Refuse values a caller gives outside :meth:`from_env`'s ranges (``None``: not given).

        :raises ValueError: ``grace_seconds`` < 0 or ``task_timeout_seconds`` <= 0, either not a finite number
            or above :data:`MAX_SECONDS`, naming it."""
        for name, value, strict in (("grace_seconds", grace_seconds, False),
                                    ("task_timeout_seconds", task_timeout_seconds, True)):
            if value is not None:
                check_number(name, value, minimum=0, strict=strict)
                if value > MAX_SECONDS:
                    raise ValueError(f"{name} must be <= {MAX_SECONDS:g} seconds, got {value!r}")

    def apply(self, watcher: PreemptionWatcher) -> None:
        """Give ``watcher`` this grace period and deadline (:func:`set_task_deadline`)."""
        watcher.grace_seconds = self.grace_seconds
        set_task_deadline(watcher, self.task_timeout_seconds)


def _safe_name(value: str, what: str) -> str:
    if not _SAFE_NAME.match(value) or value in (".", ".."):
        raise ConfigError(f"{what} {value!r} is not a safe path component ([A-Za-z0-9._-], max 128)")
    return value


@dataclasses.dataclass(frozen=True)
class TaskIdentity:
    """Who this process is, from the ``CLOUD_RUN_*`` variables.

    :param job: ``CLOUD_RUN_JOB``; default ``local``.
    :param execution: ``CLOUD_RUN_EXECUTION``; default empty.
    :param task_index: ``CLOUD_RUN_TASK_INDEX``, 0-based; default 0.
    :param task_attempt: ``CLOUD_RUN_TASK_ATTEMPT``, 0-based; default 0.
    :param task_count: ``CLOUD_RUN_TASK_COUNT``; default 1."""

    job: str = "local"
    execution: str = ""
    task_index: int = 0
    task_attempt: int = 0
    task_count: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, fallback: bool = False) -> TaskIdentity:
        """:param fallback: the defaults instead of an error when a variable is malformed.
        :raises ConfigError: when a variable is malformed (without ``fallback``)."""
        try:
            identity = cls(
                job=_safe_name(env.get("CLOUD_RUN_JOB") or "local", "CLOUD_RUN_JOB"),
                execution=_safe_name(env["CLOUD_RUN_EXECUTION"], "CLOUD_RUN_EXECUTION")
                if env.get("CLOUD_RUN_EXECUTION") else "",
                task_index=int(_env_number(env, "CLOUD_RUN_TASK_INDEX", 0, integer=True)),
                task_attempt=int(_env_number(env, "CLOUD_RUN_TASK_ATTEMPT", 0, integer=True)),
                task_count=int(_env_number(env, "CLOUD_RUN_TASK_COUNT", 1, integer=True, minimum=1)))
            if identity.task_index >= identity.task_count:
                raise ConfigError(f"CLOUD_RUN_TASK_INDEX={identity.task_index} >= CLOUD_RUN_TASK_COUNT")
            return identity
        except ConfigError:
            if fallback:
                return cls()
            raise

    def bind(self, logger: Any) -> Any:
        """
        :return: ``logger`` (a :class:`~gpu_resilience_worker.logs.StructuredLogger`) with this identity on every
            line (``job``, ``execution``, ``task_index``, ``attempt``)."""
        return logger.bind(job=self.job, execution=self.execution, task_index=self.task_index,
                           attempt=self.task_attempt)

    def namespace(self, root: str, run_id: str | None) -> str:
        """:return: ``{root}/{job}[/{run_id}]/task-{index}``."""
        return os.path.join(root.rstrip("/") or "/", self.job, *([run_id] if run_id else []), f"task-{self.task_index}")


def root_and_namespace(checkpoint_dir: str | None, run_id: str | None, env: Mapping[str, str],
                        identity: TaskIdentity) -> tuple[str, str]:
    """The checkpoint root and the task's folder in it, from the caller's values (a trainer's ``--checkpoint-dir``
    and ``--run-id``), else ``CHECKPOINT_DIR`` / ``CHECKPOINT_RUN_ID``, else :data:`DEFAULT_ROOT` and no run level.

    :param checkpoint_dir: the root; ``None``: not given.
    :param run_id: the extra namespace level; ``None``: not given.
    :param env: the environment.
    :param identity: the task (its job name and index name the folder).
    :return: ``(root, namespace)``, see :meth:`TaskIdentity.namespace`.
    :raises ConfigError: for a value given empty (a template that rendered empty must not fall back to the
        default folder or to no run level), or an unsafe run id."""
    for flag, value in (("--checkpoint-dir", checkpoint_dir), ("--run-id", run_id)):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag} is empty; leave it out for the default, or give a value")
    root = checkpoint_dir or env.get("CHECKPOINT_DIR") or DEFAULT_ROOT
    run_id = run_id or env.get("CHECKPOINT_RUN_ID") or None
    return root, identity.namespace(root, _safe_name(run_id, "run id") if run_id else None)


def task_namespace(env: Mapping[str, str] | None = None, *, root: str | None = None, run_id: str | None = None) -> str:
    """The task's checkpoint folder, as :class:`~gpu_resilience_worker.loop.ResilientLoop` and the bundled trainer
    name it: ``{root}/{CLOUD_RUN_JOB}[/{run_id}]/task-{CLOUD_RUN_TASK_INDEX}`` (outside Cloud Run the job is
    ``local`` and the index 0).

    :param env: the environment; default ``os.environ``.
    :param root: the checkpoint root (the mounted bucket); default ``$CHECKPOINT_DIR``, else ``/checkpoints``.
    :param run_id: an extra namespace level (one per DAG run); default ``$CHECKPOINT_RUN_ID`` (none when unset).
    :return: the folder path (not created).
    :raises ConfigError: a malformed ``CLOUD_RUN_*`` variable or an unsafe job name or run id."""
    env = os.environ if env is None else env
    # here an empty root or run id means "not given" (root_and_namespace refuses it)
    return root_and_namespace(root or None, run_id or None, env, TaskIdentity.from_env(env))[1]

"""``python -m gpu_resilience_worker train [flags]``: the container entry point.

Exit codes: 0 done, 143 interrupted (resumable), 78 bad configuration, 65 bad data, 73 the
checkpoint folder cannot be written (all three non-retryable, with a ``FATAL`` marker in the
namespace when it can be written), 1 any other error (retryable).
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from typing import Mapping, Sequence

from gpu_resilience_worker.config import WorkerConfig, config_from_args, guess_namespace
from gpu_resilience_worker.checkpoint import CheckpointManager
from gpu_resilience_worker.errors import EXIT_FAILURE, EXIT_OK, ConfigError, OutputError, WorkerError
from gpu_resilience_worker.files import FATAL, METRICS, read_json, write_json
from gpu_resilience_worker.logs import StructuredLogger, utc_now
from gpu_resilience_worker.preemption import PreemptionWatcher
from gpu_resilience_worker.storage import LocalStorage, Storage


def invocation(argv: Sequence[str], data_path: str | None = None) -> dict:
    """What a ``FATAL`` marker is tied to: the arguments, and the input file's size and mtime.

    :param argv: the worker's arguments.
    :param data_path: the ``.npz`` input, when the configuration got as far as naming it.
    :return: ``{"argv": [...], "data": [size in bytes, mtime in ns] or None}``.
    """
    try:
        stat = os.stat(data_path) if data_path else None
    except OSError:
        stat = None
    return {"argv": list(argv), "data": [stat.st_size, stat.st_mtime_ns] if stat else None}


def write_fatal(namespace: str | None, error: WorkerError, logger: StructuredLogger,
                called_as: dict | None = None) -> int:
    """Record a non-retryable error in ``{namespace}/FATAL`` and log it in ONE error line.

    :param called_as: the :func:`invocation` that failed; a later attempt with the same one exits
        at once, one with other arguments or another input file ignores the marker.
    :return: the error's exit code.
    """
    marker = "not written: no namespace"
    if namespace is not None:
        record = {"exit_code": error.exit_code, "reason": error.reason, "created_at": utc_now(),
                  "invocation": called_as}
        path = os.path.join(namespace, FATAL)
        try:
            write_json(LocalStorage(), path, record)
            marker = path
        except OSError as exc:
            marker = f"not written: {exc}"
    logger.error(f"fatal: {error.reason}", exit_code=error.exit_code, reason=error.reason,
                 fatal_marker=marker)
    return error.exit_code


def check_writable(namespace: str) -> None:
    """Create the namespace and write (then remove) a probe file in it.

    :raises OutputError: when it cannot be created or written for good (permission, read-only
        file system, a file in the way). Other ``OSError`` (e.g. EIO) propagate: retryable.
    """
    probe = os.path.join(namespace, ".write-probe")
    try:
        os.makedirs(namespace, exist_ok=True)
        LocalStorage().write(probe, b"probe")
        os.remove(probe)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST):
            raise OutputError(f"checkpoint folder {namespace} is not writable: {exc.strerror or exc}") from None
        raise


def fatal_marker_code(namespace: str, logger: StructuredLogger, called_as: dict | None = None) -> int | None:
    """:return: the exit code recorded by an earlier attempt's ``FATAL`` marker, if it applies.

    A marker written for another :func:`invocation` (other arguments, or an input file changed
    since) is stale: it is removed with a warning, and ``None`` is returned.
    """
    path = os.path.join(namespace, FATAL)
    if not os.path.exists(path):
        return None
    record = read_json(LocalStorage(), path) or {}
    if called_as is not None and record.get("invocation") not in (None, called_as):
        logger.warning("ignoring a FATAL marker left by other settings or input; removing it",
                       file=path, reason=record.get("reason"))
        LocalStorage().remove(path)
        return None
    code = record.get("exit_code")
    code = code if isinstance(code, int) and 64 <= code <= 78 else 78
    logger.error("an earlier attempt hit a non-retryable error; exiting at once",
                 exit_code=code, reason=record.get("reason"), file=path)
    return code


def run_is_complete(config: WorkerConfig, logger: StructuredLogger, storage: Storage | None = None) -> bool:
    """:return: whether ``metrics.json`` and the final checkpoint of this run both exist (a
    read-only look: nothing is deleted)."""
    storage = storage or LocalStorage()
    metrics = read_json(storage, os.path.join(config.namespace, METRICS))
    if metrics is None:
        return False
    saved = metrics.get("settings")
    if saved is not None and saved != config.train.fingerprint():
        details = {k: [saved.get(k), v] for k, v in config.train.fingerprint().items() if saved.get(k) != v}
        raise ConfigError(f"this namespace holds a finished run with other settings [saved, now]: {details}; "
                          "use a new --run-id (CHECKPOINT_RUN_ID) or another checkpoint folder")
    if metrics.get("steps") != config.train.steps:
        return False
    if not config.checkpoint.enabled:  # no checkpoints to check: the metrics are the record
        return True
    with CheckpointManager(config.checkpoint, {}, storage=storage, logger=logger) as manager:
        return manager.latest_step() == config.train.steps


#: oneMKL's conditional numerical reproducibility mode, set before torch (and MKL) load unless
#: ``MKL_CBWR`` is already set: ``STRICT`` makes MKL's matrix products give the same bits for
#: any number of threads and from run to run (without it, 1 and 2 threads give other products).
MKL_CBWR_DEFAULT = "AUTO,STRICT"


def _train(config: WorkerConfig, logger: StructuredLogger, watcher: PreemptionWatcher,
           storage: Storage | None) -> int:
    if run_is_complete(config, logger, storage):
        logger.info("run already complete; nothing to do", step=config.train.steps)
        return EXIT_OK
    check_writable(config.namespace)
    os.environ.setdefault("MKL_CBWR", MKL_CBWR_DEFAULT)  # read when MKL loads, with torch below
    from gpu_resilience_worker.train import Trainer  # torch is imported only when there is work to do

    watcher.grace_seconds = config.grace_seconds
    if config.task_timeout_seconds is not None:
        margin = min(config.grace_seconds, config.task_timeout_seconds / 2)
        watcher.timeout_at = watcher.started_at + config.task_timeout_seconds
        watcher.deadline = watcher.timeout_at - margin
    return Trainer(config, logger, watcher, storage).run()


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, *,
         storage: Storage | None = None) -> int:
    """Run the CLI.

    :param argv: arguments without the program name; default ``sys.argv[1:]``.
    :param env: environment; default ``os.environ``.
    :param storage: the storage of checkpoints, progress and metrics; default
        :class:`~gpu_resilience_worker.storage.LocalStorage` (tests wrap it).
    :return: the process exit code.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    env = os.environ if env is None else env
    logger = StructuredLogger()
    with PreemptionWatcher() as watcher:
        try:
            config = config_from_args(argv, env)
        except WorkerError as exc:
            return write_fatal(guess_namespace(argv, env), exc, logger, invocation(argv))
        identity = config.identity
        logger = logger.bind(job=identity.job, execution=identity.execution,
                             task_index=identity.task_index, attempt=identity.task_attempt)
        called_as = invocation(argv, config.data_path)
        code = fatal_marker_code(config.namespace, logger, called_as)
        if code is not None:
            return code
        try:
            return _train(config, logger, watcher, storage)
        except WorkerError as exc:
            return write_fatal(config.namespace, exc, logger, called_as)
        except Exception as exc:  # noqa: BLE001 - the retryable catch-all
            logger.error(f"unexpected error: {exc!r}", exit_code=EXIT_FAILURE,
                         traceback=traceback.format_exc())
            return EXIT_FAILURE


def _exit_now(code: int) -> None:
    """Flush the log streams and exit without interpreter teardown.

    Everything the worker keeps is fsynced before :func:`main` returns (an abandoned background
    save has no commit record, so it is ignored anyway). Tearing down a process with torch
    loaded takes seconds, which a preempted task would spend out of its grace period.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())

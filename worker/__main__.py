"""``python -m worker train [flags]``: the container entry point.

Exit codes: 0 done, 143 interrupted (resumable), 78 bad configuration, 65 bad data (both
non-retryable, with a ``FATAL`` marker in the namespace), 1 any other error (retryable).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Mapping, Sequence

from worker.config import WorkerConfig, config_from_args, guess_namespace
from worker.checkpoint import CheckpointManager
from worker.errors import EXIT_FAILURE, EXIT_OK, WorkerError
from worker.files import FATAL, METRICS, read_json, write_json
from worker.logs import StructuredLogger, utc_now
from worker.preemption import PreemptionWatcher
from worker.storage import LocalStorage


def write_fatal(namespace: str | None, error: WorkerError, logger: StructuredLogger) -> int:
    """Log a non-retryable error and record it in ``{namespace}/FATAL``.

    :return: the error's exit code.
    """
    logger.error(f"fatal: {error.reason}", exit_code=error.exit_code, reason=error.reason)
    if namespace is not None:
        record = {"exit_code": error.exit_code, "reason": error.reason, "created_at": utc_now()}
        try:
            write_json(LocalStorage(), os.path.join(namespace, FATAL), record)
        except OSError as exc:
            logger.error("could not write the FATAL marker", error=str(exc), namespace=namespace)
    return error.exit_code


def fatal_marker_code(namespace: str, logger: StructuredLogger) -> int | None:
    """:return: the exit code recorded by an earlier attempt's ``FATAL`` marker, if any."""
    path = os.path.join(namespace, FATAL)
    if not os.path.exists(path):
        return None
    record = read_json(LocalStorage(), path) or {}
    code = record.get("exit_code")
    code = code if isinstance(code, int) and 64 <= code <= 78 else 78
    logger.error("an earlier attempt hit a non-retryable error; exiting at once",
                 exit_code=code, reason=record.get("reason"), file=path)
    return code


def run_is_complete(config: WorkerConfig, logger: StructuredLogger) -> bool:
    """:return: whether ``metrics.json`` and the final checkpoint of this run both exist."""
    storage = LocalStorage()
    metrics = read_json(storage, os.path.join(config.namespace, METRICS))
    if metrics is None or metrics.get("steps") != config.train.steps:
        return False
    with CheckpointManager(config.checkpoint, {}, storage=storage, logger=logger) as manager:
        return manager.latest_step() == config.train.steps


def _train(config: WorkerConfig, logger: StructuredLogger, watcher: PreemptionWatcher) -> int:
    if run_is_complete(config, logger):
        logger.info("run already complete; nothing to do", step=config.train.steps)
        return EXIT_OK
    from worker.train import Trainer  # torch is imported only when there is work to do

    watcher.grace_seconds = config.grace_seconds
    if config.task_timeout_seconds is not None:
        margin = min(config.grace_seconds, config.task_timeout_seconds / 2)
        watcher.deadline = watcher.started_at + config.task_timeout_seconds - margin
    return Trainer(config, logger, watcher).run()


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run the CLI.

    :param argv: arguments without the program name; default ``sys.argv[1:]``.
    :param env: environment; default ``os.environ``.
    :return: the process exit code.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    env = os.environ if env is None else env
    logger = StructuredLogger()
    with PreemptionWatcher() as watcher:
        try:
            config = config_from_args(argv, env)
        except WorkerError as exc:
            return write_fatal(guess_namespace(argv, env), exc, logger)
        identity = config.identity
        logger = logger.bind(job=identity.job, execution=identity.execution,
                             task_index=identity.task_index, attempt=identity.task_attempt)
        code = fatal_marker_code(config.namespace, logger)
        if code is not None:
            return code
        try:
            return _train(config, logger, watcher)
        except WorkerError as exc:
            return write_fatal(config.namespace, exc, logger)
        except Exception as exc:  # noqa: BLE001 - the retryable catch-all
            logger.error(f"unexpected error: {exc!r}", exit_code=EXIT_FAILURE,
                         traceback=traceback.format_exc())
            return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())

"""``python -m gpu_resilience_trainer train [flags]``: the bundled trainer's container entry point.

Exit codes: 0 done, 143 interrupted (resumable), 78 bad configuration, 65 bad data, 70
diverged, 73 the checkpoint folder cannot be written, 74 three checkpoint saves in a row found
its file system full (all non-retryable, with a ``FATAL`` marker in the namespace when it can
be written), 1 any other error (retryable).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Sequence

from gpu_resilience_trainer.config import WorkerConfig, config_from_args, guess_namespace
from gpu_resilience_worker.checkpoint import CheckpointManager
from gpu_resilience_worker.errors import EXIT_OK, ConfigError, WorkerError
from gpu_resilience_worker.fatal import check_writable, invocation, run_guarded, write_fatal
from gpu_resilience_worker.files import METRICS, read_json
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.preemption import PreemptionWatcher, exit_now
from gpu_resilience_worker.storage import LocalStorage, Storage


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

#: What the worker sets before torch loads, each unless already set: the conditions oneMKL's
#: developer guide gives for run-to-run reproducible results ("Reproducibility Conditions"):
#: the strict mode above, and ``MKL_DYNAMIC``/``OMP_DYNAMIC`` off, so that neither MKL nor the
#: OpenMP runtime adjusts the number of threads at run time (torch's own parallel reductions
#: split their sums by the threads they get).
REPRODUCIBILITY_ENV = {"MKL_CBWR": MKL_CBWR_DEFAULT, "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}


def _train(config: WorkerConfig, logger: StructuredLogger, watcher: PreemptionWatcher,
           storage: Storage | None, argv: Sequence[str], env: Mapping[str, str]) -> int:
    if run_is_complete(config, logger, storage):
        logger.info("run already complete; nothing to do", step=config.train.steps)
        return EXIT_OK
    check_writable(config.namespace)
    for name, value in REPRODUCIBILITY_ENV.items():  # read when MKL and OpenMP load, with torch below
        os.environ.setdefault(name, value)
    from gpu_resilience_trainer import train  # torch is imported only when there is work to do

    config.timing.apply(watcher)  # the deadline counts during the imports and the build too
    return train.run(config, logger, watcher, storage, argv=list(argv), env=env)


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
            # a retry of this invocation finds the same error: write_fatal keeps its marker as it is
            return write_fatal(guess_namespace(argv, env), exc, logger, invocation(argv))
        logger = config.identity.bind(logger)
        called_as = invocation(argv, config.data_path)
        return run_guarded(config.namespace, logger, called_as,
                           lambda: _train(config, logger, watcher, storage, argv, env))

if __name__ == "__main__":
    exit_now(main())

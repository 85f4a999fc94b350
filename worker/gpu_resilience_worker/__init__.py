"""Preemption-safe PyTorch checkpointing for Cloud Run GPU jobs: the worker library.

Depends on torch and the standard library only: it imports no Airflow, Google package, numpy, nor the bundled
digits trainer (package ``gpu_resilience_trainer`` of the same distribution, an application of this library).
Three ways in: the bundled trainer, your own loop (:class:`ResilientLoop`, :func:`run_training`, or pieces such as
:class:`CheckpointManager`), and a framework (``gpu_resilience_worker.integrations``, each with its own extra).
The public names are those of ``_EXPORTS`` below, grouped by purpose in the worker README ("The public API")."""

__version__ = "0.1.0"

#: Public name -> the module that defines it, imported on first use (PEP 562) so that ``import gpu_resilience_worker``
#: loads nothing (torch included): the trainer's CLI sets ``MKL_CBWR`` before torch loads, a user's script decides when.
_EXPORTS = {
    "checkpoint": ("CheckpointManager", "CheckpointSaveError", "RestoreInterrupted", "Stateful"),
    "commit": ("CheckpointName", "CommitRecord", "CommitStore"),
    "errors": ("EXIT_OK", "EXIT_PREEMPTED", "ConfigError", "DataError", "DivergedError", "NewerCheckpointError",
               "OutOfSpaceError", "OutputError", "SavesFailingError", "WorkerError"),
    "fatal": ("fatal_marker_code", "write_fatal"),
    "files": ("ATTEMPTS", "FATAL", "METRICS", "PROGRESS", "ProgressReporter", "read_json", "record_attempt",
              "write_json"),
    "logs": ("StructuredLogger",),
    "loop": ("ResilientLoop", "run_training", "task_namespace"),
    "policies": ("AsyncMode", "CheckpointConfig"),
    "preemption": ("PreemptionWatcher", "exit_now", "ignore_termination_signals", "set_task_deadline"),
    "state": ("TrainState", "state_digest"),
    "storage": ("LocalStorage", "Storage"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    """Import a public name's module on first use (see :data:`_EXPORTS`)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(list(globals()) + list(_MODULE_OF))


__all__ = sorted(_MODULE_OF)

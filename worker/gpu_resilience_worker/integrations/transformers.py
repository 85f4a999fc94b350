"""``transformers.Trainer`` checkpoints through the commit protocol, with the preemption rules.

Install with the extra: ``pip install './worker[transformers]'``. Use::

    callback = CommitCallback()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.latest())
    callback.finish()

An adapter of :class:`~gpu_resilience_worker.artifacts.ArtifactCheckpoints`: it commits each ``checkpoint-<step>/``
Trainer writes (``save_total_limit`` must be unset: Trainer's rotation would keep a torn folder over a committed one),
deletes uncommitted ones when the Trainer is built, answers a stop through the stop decision (``SystemExit(143)``)
and records the attempt. The rules in full: ``docs/your-code.rst``."""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from gpu_resilience_worker.artifacts import ArtifactCheckpoints
from gpu_resilience_worker.errors import EXIT_OK
from gpu_resilience_worker.logs import StructuredLogger

PREFIX = "checkpoint-"


class CommitCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that commits Trainer's checkpoints and handles SIGTERM.

    :param keep_latest_k: committed checkpoints to keep (>= 2); default 2.
    :param grace_seconds: SIGTERM to SIGKILL, in seconds; default ``PREEMPTION_GRACE_SECONDS`` or 10.
    :param logger: structured logger; default one on stdout.
    :raises ValueError: for ``keep_latest_k`` < 2 or ``grace_seconds`` < 0 (here), and, when the Trainer is built,
        for ``TrainingArguments.save_total_limit`` set or ``save_strategy="no"``."""

    def __init__(self, keep_latest_k: int = 2, grace_seconds: float | None = None,
                 logger: StructuredLogger | None = None) -> None:
        ArtifactCheckpoints(".", prefix=PREFIX, keep_latest_k=keep_latest_k, grace_seconds=grace_seconds)
        self._options = {"keep_latest_k": keep_latest_k, "grace_seconds": grace_seconds, "logger": logger}
        self.checkpoints: ArtifactCheckpoints | None = None
        self._stop_after_commit = False

    # set-up and resume ---------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Check the arguments, install the SIGTERM handler, delete uncommitted checkpoints."""
        if args.save_total_limit is not None:
            raise ValueError("TrainingArguments.save_total_limit must be None with CommitCallback "
                             f"(got {args.save_total_limit!r}): use CommitCallback(keep_latest_k=...)")
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "no":
            raise ValueError("TrainingArguments.save_strategy must be 'steps' or 'epoch' with CommitCallback, got 'no'")
        self.checkpoints = ArtifactCheckpoints(args.output_dir, prefix=PREFIX, **self._options)
        if args.should_save:
            self.checkpoints.cleanup_uncommitted()
        self.checkpoints.watcher.install()

    def latest(self) -> str | None:
        """:return: the newest committed, verified ``checkpoint-<step>`` folder, or ``None``.
        :raises RuntimeError: before the Trainer holding this callback was built."""
        return self._require().latest()

    def finish(self) -> None:
        """Restore the signal handlers that were there before (call after ``train()`` returned)."""
        if self.checkpoints is not None:
            self.checkpoints.watcher.uninstall()

    def _require(self) -> ArtifactCheckpoints:
        if self.checkpoints is None:
            raise RuntimeError("CommitCallback is not attached: pass it in Trainer(callbacks=[...]) first")
        return self.checkpoints

    # saves -----------------------------------------------------------------------------------------
    def _before_possible_save(self, args: Any, state: Any, control: Any) -> None:
        checkpoints = self._require()
        action = checkpoints.stop_action(state.global_step)
        if action == "exit":
            checkpoints.exit_preempted(state.global_step)
        if action == "save":
            control.should_save = True
            control.should_training_stop = True
            self._stop_after_commit = True
        if control.should_save and args.should_save:
            checkpoints.begin_save(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Account the step; decide on a stop after SIGTERM; clear a stale checkpoint of a step about to be saved."""
        self._require().step_done(state.global_step)
        self._before_possible_save(args, state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Clear a stale checkpoint of a step about to be saved at the epoch end."""
        if control.should_save and args.should_save:
            self._require().begin_save(state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Commit the folder Trainer just wrote; stop when a SIGTERM arrived."""
        checkpoints = self._require()
        if args.should_save:
            if not os.path.isdir(checkpoints.path(state.global_step)):
                raise FileNotFoundError(f"Trainer saved no folder at {checkpoints.path(state.global_step)}")
            checkpoints.commit(state.global_step)
        if self._stop_after_commit or checkpoints.watcher.requested:
            checkpoints.exit_preempted(state.global_step)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Record the attempt (Trainer restored its checkpoint by now) and log the step training starts from."""
        if args.should_save:
            self._require().begin_attempt(state.global_step, state.max_steps)
        self._require().log.info("training started", step=state.global_step, max_steps=state.max_steps)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """End the attempt's account as complete and log it (the handlers stay until :meth:`finish`)."""
        checkpoints = self._require()
        checkpoints.end_attempt(state.global_step, EXIT_OK)
        checkpoints.log.info("training finished", step=state.global_step, last_committed=checkpoints.last_committed)

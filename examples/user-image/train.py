"""A user's own training script on the worker library: a plain PyTorch loop, made preemption-safe.

It trains a small MLP classifier on a synthetic dataset (made from the seed: no download, no
numpy) with :class:`gpu_resilience_worker.ResilientLoop`, which resumes from the newest committed
checkpoint, saves every ``--checkpoint-every`` steps, flushes on SIGTERM within the grace period
or at the task deadline, and exits 143 (resumable), 0 when done.

It accepts the flags the example DAGs pass to the bundled worker (``train --steps=N
--checkpoint-every=N --step-delay=S --hidden=N --seed=N``), so a DAG runs it by changing only its
``image`` param; the checkpoint folder comes from ``CHECKPOINT_DIR``, ``CLOUD_RUN_JOB``,
``CHECKPOINT_RUN_ID`` and ``CLOUD_RUN_TASK_INDEX``, as for the bundled worker. ``metrics.json``
gets the held-out ``accuracy`` the DAG's report prints.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from gpu_resilience_worker import ResilientLoop, exit_now, state_digest
from gpu_resilience_worker.loop import PREEMPTION_SAVES

FEATURES, CLASSES, TRAIN, TEST = 32, 8, 2048, 512


def parse_args(argv: list[str]) -> argparse.Namespace:
    """:return: the flags; the leading ``train`` command is optional."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", default="train", choices=["train"])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of the whole run")
    parser.add_argument("--checkpoint-every", type=int, default=25, help="steps between checkpoints")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds to wait per step (demos)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden units per layer")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the batches")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--preemption-save", choices=PREEMPTION_SAVES, default="deadline",
                        help="save at a stop: when it fits the grace period (deadline), always, or never")
    return parser.parse_args(argv)


def synthetic_data(seed: int) -> tuple[torch.Tensor, ...]:
    """Points labelled by a random linear teacher: ``x`` float32 [N, 32], ``y`` int64 [N] in [0, 8)."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    x = torch.randn(TRAIN + TEST, FEATURES, generator=generator)
    y = (x @ teacher).argmax(dim=1)
    return x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]


def main(argv: list[str]) -> int:
    """Build everything from the seed, then let the loop resume and train. :return: exit code."""
    args = parse_args(argv)
    x_train, y_train, x_test, y_test = synthetic_data(args.seed)
    torch.manual_seed(args.seed)  # model init, dropout and batch order; a resume restores the RNG
    model = nn.Sequential(nn.Linear(FEATURES, args.hidden), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(args.hidden, CLASSES))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    loop = ResilientLoop(
        {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler},
        total_steps=args.steps, checkpoint_every=args.checkpoint_every, preemption_save=args.preemption_save,
        settings={"hidden": args.hidden, "seed": args.seed, "batch_size": args.batch_size, "lr": args.lr},
    )

    def step(done: int) -> float:
        batch = torch.randint(0, TRAIN, (args.batch_size,))
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
        loss.backward()
        optimizer.step()
        scheduler.step()
        if args.step_delay:
            loop.wait(args.step_delay)
        return loss.item()

    def finish() -> dict:
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
        return {"accuracy": accuracy, "test_samples": TEST, "model_sha256": state_digest(model.state_dict())}

    return loop.run(step, finish)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))

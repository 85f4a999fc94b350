"""Your own training loop around ResilientLoop (the "Your training code" page shows it).

Run as a script by tests/worker/test_readme_example.py (100 steps, then a second run that resumes
at step 100), by tests/worker/test_clean_install.py (in a virtual environment with only the
worker library and torch) and by tests/worker/test_own_loop_flags.py (a bad flag: FATAL, exit 78;
on Cloud Run, the default task folder).
"""

# [START howto_own_loop]
import argparse
import os

import torch
from gpu_resilience_worker import ConfigError, ResilientLoop, StructuredLogger, exit_now, task_namespace, write_fatal


class Flags(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # a bad flag fails every retry alike: FATAL and exit 78,
        raise ConfigError(f"invalid arguments: {message}")  # not argparse's exit 2, which Cloud Run retries


# On Cloud Run (CLOUD_RUN_JOB is set) the default task folder, which the execute operator reads:
# $CHECKPOINT_DIR/$CLOUD_RUN_JOB[/$CHECKPOINT_RUN_ID]/task-$CLOUD_RUN_TASK_INDEX. Run by hand, a folder here.
folder = None if os.environ.get("CLOUD_RUN_JOB") else "checkpoints/own-loop"
parser = Flags()
parser.add_argument("--steps", type=int, default=100)
try:
    flags = parser.parse_args()
except ConfigError as error:
    exit_now(write_fatal(folder or task_namespace(), error, StructuredLogger()))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(256, 8)
y = x.sum(dim=1, keepdim=True)


def step(done: int) -> float:  # done: steps already done; draw batches from torch's RNG (it is checkpointed)
    batch = torch.randint(0, 256, (32,))
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
    loss.backward()
    optimizer.step()
    return loss.item()


loop = ResilientLoop({"model": model, "optimizer": optimizer}, total_steps=flags.steps, checkpoint_every=20,
                     folder=folder)
exit_now(loop.run(step, finish=lambda: {"final_weight_norm": model[0].weight.norm().item()}))
# [END howto_own_loop]

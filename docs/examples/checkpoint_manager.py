"""The checkpoint manager and the preemption watcher in a loop of your own shape (the "Your
training code" page).

Run by tests/worker/test_readme_example.py (30 steps, then a run that loads step 30) and, with
DataLoader workers and a real SIGTERM, by tests/worker/test_dataloader_recipe.py.
"""

# [START howto_checkpoint_manager]
import torch

from gpu_resilience_worker.checkpoint import CheckpointConfig, CheckpointManager
from gpu_resilience_worker.preemption import SAVE, PreemptionWatcher, decide_stop, ignore_termination_signals

STEPS = 30


class Progress:
    """Any object with state_dict/load_state_dict can be checkpointed."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def batches(loader):
    while True:  # one epoch after the other
        yield from loader


model = torch.nn.Linear(4, 2)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
progress = Progress()
states = {"model": model, "optimizer": optimizer, "train_state": progress}
config = CheckpointConfig(folder="checkpoints/my-run", interval=10)  # async saves, keep 2
data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 2))
loader = torch.utils.data.DataLoader(  # workers survive Cloud Run's process-group SIGTERM
    data, batch_size=8, shuffle=True, num_workers=2, persistent_workers=True,
    worker_init_fn=ignore_termination_signals,
)

with PreemptionWatcher() as watcher, CheckpointManager(config, states) as manager:
    manager.load()  # the newest valid checkpoint, if there is one
    stream = batches(loader)
    while progress.step < STEPS:
        if watcher.requested:  # SIGTERM/SIGINT: the worker's stop decision, then exit 143
            settled = manager.wait_until_finished(timeout=max(0.0, watcher.remaining_grace() - 1))
            decision = decide_stop(requested=True, step=progress.step, last_committed=manager.last_saved_step,
                                   estimated_save_seconds=manager.estimated_save_seconds,
                                   remaining_grace=watcher.remaining_grace(), save_abandoned=not settled)
            if decision.action == SAVE:  # a save that fits the grace left, of a step not committed
                manager.save(progress.step, force=True)
            raise SystemExit(143)
        x, y = next(stream)
        loss = (model(x) - y).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        progress.step += 1
        manager.save(progress.step)  # on interval steps: blocks only for the host copy
    manager.save(progress.step, force=True)  # the final step: synchronous, unless just saved
# [END howto_checkpoint_manager]

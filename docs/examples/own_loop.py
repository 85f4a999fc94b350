"""Your own training loop around ResilientLoop (the "Your training code" page shows it).

Run as a script by tests/worker/test_readme_example.py (100 steps, then a second run that resumes
at step 100) and by tests/worker/test_clean_install.py (in a virtual environment with only the
worker library and torch).
"""

# [START howto_own_loop]
import torch
from gpu_resilience_worker import ResilientLoop, exit_now

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


loop = ResilientLoop({"model": model, "optimizer": optimizer}, total_steps=100, checkpoint_every=20,
                     folder="checkpoints/own-loop")
exit_now(loop.run(step, finish=lambda: {"final_weight_norm": model[0].weight.norm().item()}))
# [END howto_own_loop]

"""Lightning Trainer.fit with CommitCheckpoint and ResumableLoader (the "Your training code" page).

Run by tests/worker/test_lightning_integration.py in real processes interrupted by SIGTERM and
SIGKILL, against an uninterrupted run, bit for bit.
"""

# [START howto_lightning_fit]
import lightning
import torch

from gpu_resilience_worker.integrations.lightning import CommitCheckpoint, ResumableLoader


class Regression(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))  # synthetic data
data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
torch.manual_seed(0)
model = Regression()
callback = CommitCheckpoint("checkpoints", every_n_steps=5)
trainer = lightning.Trainer(max_steps=600, callbacks=[callback], enable_checkpointing=False, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
trainer.fit(model, ResumableLoader(data, batch_size=16, seed=0), ckpt_path=callback.latest())
torch.save(model.state_dict(), "final.pt")
# [END howto_lightning_fit]

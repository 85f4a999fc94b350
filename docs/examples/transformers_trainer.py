"""transformers.Trainer with the worker library's CommitCallback (the "Your training code" page).

Run by tests/worker/test_transformers_integration.py in real processes interrupted by SIGTERM and
SIGKILL, against an uninterrupted run, bit for bit.
"""

# [START howto_transformers_trainer]
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from gpu_resilience_worker.integrations.transformers import CommitCallback


class Tokens(torch.utils.data.Dataset):  # synthetic: 64 sequences of 8 tokens
    ids = torch.randint(0, 32, (64, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
args = TrainingArguments("out", max_steps=300, save_steps=5, per_device_train_batch_size=8, use_cpu=True,
                         seed=0, report_to="none", logging_strategy="no", disable_tqdm=True)
callback = CommitCallback()
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
trainer.train(resume_from_checkpoint=callback.latest())  # None on the first attempt
callback.finish()
trainer.save_model("out/final")
# [END howto_transformers_trainer]

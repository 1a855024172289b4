"""A tiny sharded training run that checkpoints every step and resumes from its last complete checkpoint.

``train_with_faults.py OUT SEED inject|clean``: with ``inject``, attempt 0 SIGKILLs one rank and attempt 1
raises on one rank, at steps and ranks drawn from SEED; run under ``fullshard launch --max_restarts 2``
it must end with the same weights, bit for bit, as the ``clean`` run. The final full state dict goes to
OUT/final.pt. It is written as a user would write a restartable script: automatic checkpoint naming under OUT
(every step, the newest three kept), ``load_state()`` of the latest complete checkpoint when there is one, and the
stateful data loader so that the position within the epoch comes back too. A rank killed mid-save leaves a
partial checkpoint that is never taken as the latest.
"""

import os
import random
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fullshard import Accelerator, DataLoaderConfiguration, ProjectConfiguration
from fullshard.utils import latest_checkpoint, set_seed

out, seed, inject = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "inject"
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
SAMPLES, BATCH, EPOCHS, RANKS = 32, 4, 2, 2
TOTAL = EPOCHS * SAMPLES // (BATCH * RANKS)  # optimizer steps of the whole run
draw = random.Random(seed)
kill_step = draw.randrange(1, TOTAL - 1)
raise_step = draw.randrange(kill_step + 1, TOTAL + 1)
kill_rank, raise_rank = draw.randrange(RANKS), draw.randrange(RANKS)


class Progress:
    """The optimizer steps taken so far, saved with the checkpoint."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


set_seed(0)
accelerator = Accelerator(
    cpu=True,
    dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    project_config=ProjectConfiguration(out, automatic_checkpoint_naming=True, total_limit=3),
)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
generator = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(SAMPLES, 8, generator=generator), torch.randn(SAMPLES, 1, generator=generator))
loader = DataLoader(data, batch_size=BATCH, shuffle=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
progress = Progress()
accelerator.register_for_checkpointing(progress)

latest = latest_checkpoint(out)
if latest is not None:
    accelerator.load_state()
    accelerator.print(f"RESUMED from {latest.name} at step {progress.step} on attempt {attempt}", flush=True)

while progress.step < TOTAL:
    for x, y in loader:
        step = progress.step + 1
        me = accelerator.process_index
        if inject and attempt == 0 and step == kill_step and me == kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if inject and attempt == 1 and step == raise_step and me == raise_rank:
            raise RuntimeError(f"injected failure at step {step} on rank {me}")
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        progress.step = step
        accelerator.save_state()
        if progress.step >= TOTAL:
            break

state = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    torch.save(state, out / "final.pt")
accelerator.end_training()

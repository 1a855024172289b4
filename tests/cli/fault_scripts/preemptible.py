"""Trains until preempted or until TOTAL steps: ``preemptible.py OUT handler|no_handler [TOTAL]``.

With ``handler``, SIGTERM sets the trigger, the step ends, the training state is saved to OUT and the script
exits 0; without it, SIGTERM kills the workers. A run that finds a checkpoint in OUT resumes from it. A run that
reaches TOTAL steps writes the final weights to OUT/final.pt, so a preempted-then-resumed run can be compared
with an uninterrupted one.
"""

import sys
import time
from pathlib import Path

import torch

from fullshard import Accelerator
from fullshard.utils import install_preemption_handler, set_seed

out, use_handler = Path(sys.argv[1]), sys.argv[2] == "handler"
total = int(sys.argv[3]) if len(sys.argv) > 3 else 10_000


class Progress:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


if use_handler:
    install_preemption_handler()
set_seed(0)
accelerator = Accelerator(cpu=True)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
model, optimizer = accelerator.prepare(model, optimizer)
progress = Progress()
accelerator.register_for_checkpointing(progress)
if out.is_dir():  # save_state commits the folder whole (renamed into place), so its presence means complete
    accelerator.load_state(out)
    accelerator.print(f"RESUMED at step {progress.step}", flush=True)
inputs = torch.randn(16, 4, generator=torch.Generator().manual_seed(accelerator.process_index))
while progress.step < total:
    rows = inputs[progress.step % 8 * 2 : progress.step % 8 * 2 + 2]
    loss = model(rows).square().mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    progress.step += 1
    accelerator.print(f"STEP {progress.step}", flush=True)
    time.sleep(0.1)
    if accelerator.check_trigger():
        accelerator.save_state(out)
        accelerator.print(f"PREEMPTED after step {progress.step}; saved {out}", flush=True)
        break
else:
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save(state, out.with_suffix(".final.pt"))
accelerator.end_training()

"""Trains until preempted: with ``handler`` in argv, SIGTERM sets the trigger, the step ends, a checkpoint
is saved and the script exits 0; without it, SIGTERM kills the workers."""

import sys
import time

import torch

from fullshard import Accelerator
from fullshard.utils import install_preemption_handler

out, use_handler = sys.argv[1], sys.argv[2] == "handler"
if use_handler:
    install_preemption_handler()
accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
for step in range(10_000):
    loss = model(torch.ones(2, 4)).square().mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.print(f"STEP {step}", flush=True)
    time.sleep(0.1)
    if accelerator.check_trigger():
        accelerator.save_state(out)
        accelerator.print(f"PREEMPTED after step {step}; saved {out}", flush=True)
        break
accelerator.end_training()

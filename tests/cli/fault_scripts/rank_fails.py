"""Rank 1 fails after a first collective (``raise`` or ``kill``); rank 0 goes on to a second collective."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from fullshard.frontend.processes import runtime

state = runtime.init_process_state(cpu=True)
total = torch.ones(1)
dist.all_reduce(total)
if state.process_index == 1:
    sys.stdout.write(f"FAILING at={time.time():.3f}\n")
    sys.stdout.flush()
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("injected failure on rank 1")
dist.all_reduce(total)
time.sleep(60)

"""Attempts 0..K-1: one rank SIGKILLs itself right after a first collective; attempt K: every rank must come
back, run a collective and print it. ``sys.argv[1]`` = K (the launcher's --max_restarts)."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from fullshard.frontend.processes import runtime

attempt, last = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(sys.argv[1])
state = runtime.init_process_state(cpu=True)
total = torch.tensor([state.process_index + 1.0])
dist.all_reduce(total)
now = time.time()
if attempt < last:
    if state.process_index == attempt % state.num_processes:
        sys.stdout.write(f"KILL attempt={attempt} rank={state.process_index} at={now:.3f}\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # the launcher stops this rank when it sees the other one die
sys.stdout.write(f"BACK attempt={attempt} rank={state.process_index} sum={total.item():g} at={now:.3f}\n")
sys.stdout.flush()
runtime.shutdown()

"""Rank 1 leaves step after a first training step: ``extra_forward`` (it runs one forward more than rank 0),
``hang`` (it stops itself with SIGSTOP) or ``kill`` (SIGKILL). ``FULLSHARD_TIMEOUT`` bounds the wait of the
rank left alone. Units have different sizes, so mismatched collectives would make gloo abort."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from fullshard import FullyShardedDataParallel
from fullshard.engine import shm
from fullshard.engine.wrap import ModuleWrapPolicy
from fullshard.frontend.processes import runtime

state = runtime.init_process_state(cpu=True)
if sys.argv[1] == "kill" and state.process_index == 0:
    # The launcher SIGTERMs the ranks left once rank 1 is gone; on a busy machine that signal could end rank 0
    # before its collective noticed the lost peer and it printed its one line (what the test reads). Ignored
    # here, rank 0 always reaches its report, then exits 1 on its own.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
torch.manual_seed(0)
# Units of different sizes, as in a real model: a collective of one meets another's of another size.
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def step() -> None:
    model(torch.ones(2, 8)).sum().backward()


step()
# The gathers and reductions of ranks on one host go through shared memory (engine/shm.py): the test checks that
# the faults above are caught there.
sys.stdout.write(f"SHARED MEMORY {shm.channel(dist.group.WORLD, 4, torch.device('cpu')) is not None}\n")
if state.process_index == 1:
    sys.stdout.write(f"DIVERGING at={time.time():.3f}\n")
    sys.stdout.flush()
    if sys.argv[1] in ("hang", "kill"):
        os.kill(os.getpid(), signal.SIGSTOP if sys.argv[1] == "hang" else signal.SIGKILL)
    else:
        with torch.no_grad():
            model(torch.ones(2, 8))
step()
time.sleep(30)  # a rank that got through waits here; the launcher must end it

"""A rank killed while a background save (``save_state(async_save=True)``) is being written.

``async_save_killed.py OUT``, under ``fullshard launch --max_restarts 1``. Attempt 0: one step, a background save
of ``checkpoint_0`` (its state also to OUT/at_save.pt), one more step, a background save of ``checkpoint_1``
during whose write rank 1 SIGKILLs itself (after its optimizer shard is written). Attempt 1: loads the latest
complete checkpoint, writes its state to OUT/resumed.pt and prints ``RESUMED <folder>``.
"""

import os
import signal
import sys
import threading
from pathlib import Path

import torch
from torch import nn

from fullshard import Accelerator, FullyShardedDataParallelPlugin, ProjectConfiguration
from fullshard.checkpoint import transaction
from fullshard.utils import latest_checkpoint, set_seed

out = Path(sys.argv[1])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
set_seed(0)
accelerator = Accelerator(
    cpu=True,
    fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"),
    project_config=ProjectConfiguration(out, automatic_checkpoint_naming=True),
)
model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)


def step() -> None:
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()


def killing_write(state, folder, **kwargs):  # rank 1, in the background thread, mid-save of checkpoint_1
    records = real_write(state, folder, **kwargs)
    if Path(folder).name.startswith("optimizer") and "checkpoint_1" in str(folder):
        print(f"KILLING rank 1 in thread {threading.current_thread().name}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return records


if attempt == 0:
    step()
    accelerator.save_state(async_save=True)  # checkpoint_0
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save(state, out / "at_save.pt")
    step()
    real_write = transaction.write_sharded
    if accelerator.process_index == 1:
        transaction.write_sharded = killing_write
    accelerator.save_state(async_save=True)  # checkpoint_1: waits for checkpoint_0 first
    step()  # training runs on while checkpoint_1 is written, until rank 1 dies
    accelerator.end_training()
else:
    latest = latest_checkpoint(out)
    accelerator.load_state()
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save(state, out / "resumed.pt")
    accelerator.print(f"RESUMED {latest.name if latest else None}", flush=True)
    accelerator.end_training()

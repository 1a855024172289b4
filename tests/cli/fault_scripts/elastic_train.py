"""World-size-invariant training that saves every step and resumes from the latest complete checkpoint.

    python elastic_train.py OUT STEPS [PAUSE_S]                  # one process: the reference
    fullshard launch --nproc_per_node 2 --nnodes 1:2 --rdzv_backend c10d --rdzv_endpoint HOST:PORT \\
        --max_restarts 3 elastic_train.py OUT STEPS [PAUSE_S]    # on each machine

``fully_shard`` with ``invariant_micro_batches=4``: every step's global batch is cut into 4 micro-batches, dealt by
global index (rank ``r`` of ``N`` runs ``r*4/N .. (r+1)*4/N - 1``), so the weights after every step are bitwise the
same on 1, 2 or 4 ranks, and a run that loses ranks and resumes from its last checkpoint on fewer ends with the
uninterrupted run's weights. Each step ends with ``save_state()`` (``OUT/checkpoints/checkpoint_<i>``); a (re)start
loads the latest complete one. Prints ``STEP <s> world=<N> attempt=<restart count> at=<time>`` (each machine's
first process) and, at the end,
writes the full weights to ``OUT/final.pt``. ``PAUSE_S`` sleeps after each step, to leave time for a kill.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fullshard import Accelerator, FullyShardedDataParallelPlugin, ProjectConfiguration, fully_shard
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch
from fullshard.utils import latest_checkpoint

G, MICRO_ROWS = 4, 2
CFG = GPTConfig(n_embd=40, n_head=4)


class Progress:
    """The number of steps done, saved with the checkpoint."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    torch.set_num_threads(1)  # the same kernels on every world size
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    project = ProjectConfiguration(str(out), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(fsdp_plugin=plugin, project_config=project)
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    for block in model.blocks:
        fully_shard(block, invariant_micro_batches=G)
    fully_shard(model, invariant_micro_batches=G)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if latest_checkpoint(out) is not None:
        accelerator.load_state()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    per_rank = G // world
    for step in range(progress.step, steps):
        x, y = make_batch(CFG, G * MICRO_ROWS, seed=1000 + step)  # the global batch
        for k in range(per_rank):
            rows = slice((rank * per_rank + k) * MICRO_ROWS, (rank * per_rank + k + 1) * MICRO_ROWS)
            (model(x[rows], y[rows]) / per_rank).backward()
        opt.step()
        opt.zero_grad()
        progress.step = step + 1
        accelerator.save_state()
        accelerator.print(f"STEP {step + 1} world={world} attempt={attempt} at={time.time():.2f}", flush=True)
        time.sleep(pause)
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save(weights, out / "final.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()

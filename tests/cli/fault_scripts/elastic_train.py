"""World-size-invariant training that saves every step and resumes from the latest complete checkpoint.

    python elastic_train.py OUT STEPS [PAUSE_S]                  # one process: the reference
    fullshard launch --nproc_per_node 2 --nnodes 1:2 --rdzv_backend c10d --rdzv_endpoint HOST:PORT \\
        --max_restarts 3 elastic_train.py OUT STEPS [PAUSE_S]    # on each machine

World-size-invariant mode through the Accelerator: ``FullyShardedDataParallelPlugin(invariant_micro_batches=4)``
and a shuffled prepared loader of micro-batches (``use_stateful_dataloader=True``, so the checkpoint holds the
data position), run with ``accumulate()``: every step's global batch is 4 micro-batches, rank ``r`` of ``N`` runs
``r*4/N .. (r+1)*4/N - 1``, so the weights after every step are bitwise the same on 1, 2 or 4 ranks, and a run
that loses ranks and resumes from its last checkpoint on fewer ends with the uninterrupted run's weights. Each step
ends with ``save_state()`` (``OUT/checkpoints/checkpoint_<i>``); a (re)start loads the latest complete one. Prints
``STEP <s> world=<N> attempt=<restart count> at=<time>`` (each machine's first process) and, at the end, writes
the full weights to ``OUT/final.pt``. ``PAUSE_S`` sleeps after each step, to leave time for a kill.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from fullshard import Accelerator, DataLoaderConfiguration, FullyShardedDataParallelPlugin, ProjectConfiguration
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch
from fullshard.utils import latest_checkpoint, set_seed

G, MICRO_ROWS, SAMPLES = 4, 2, 40  # 8 samples a step: 5 steps an epoch
CFG = GPTConfig(n_embd=40, n_head=4)
X, Y = make_batch(CFG, SAMPLES, seed=7)  # sample i is (X[i], Y[i]); the loader deals indices


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
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        state_dict_type="SHARDED_STATE_DICT",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        invariant_micro_batches=G,
    )
    project = ProjectConfiguration(str(out), automatic_checkpoint_naming=True, total_limit=2)
    data = DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = Accelerator(fsdp_plugin=plugin, project_config=project, dataloader_config=data)
    set_seed(0)
    model = TinyGPT(CFG)
    loader = DataLoader(list(range(SAMPLES)), batch_size=MICRO_ROWS, shuffle=True)
    model, opt, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if latest_checkpoint(out) is not None:
        accelerator.load_state()
    attempt, world = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), accelerator.num_processes
    while progress.step < steps:
        for idx in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(X[idx], Y[idx]))
                opt.step()
                opt.zero_grad()
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            accelerator.save_state()
            accelerator.print(f"STEP {progress.step} world={world} attempt={attempt} at={time.time():.2f}", flush=True)
            time.sleep(pause)
            if progress.step == steps:
                break
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save(weights, out / "final.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()

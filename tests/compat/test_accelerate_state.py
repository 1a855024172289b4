"""A checkpoint written by Accelerate 1.15's own save code loads with fullshard's Accelerator.load_state.

Accelerate's ``save_state`` with FSDP2 writes the model and optimizer with ``save_fsdp_model`` /
``save_fsdp_optimizer`` and the rest with ``save_accelerator_state``; Accelerate refuses FSDP on CPU, so
the test calls those same functions, as its ``save_state`` does. ``random_states_<rank>.pkl`` then holds
numpy's RNG state as a numpy array, which fullshard admits through an allow-list, not by unpickling
arbitrary objects.
"""

from __future__ import annotations

import os
import random
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from fullshard import Accelerator, FullyShardedDataParallelPlugin
from fullshard.testing import WorkerPool, run_on_ranks

np = pytest.importorskip("numpy")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _objects(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _accelerate_saves(rank: int, world: int, root: str) -> Any:
    from accelerate import FullyShardedDataParallelPlugin as AcceleratePlugin
    from accelerate import PartialState
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.utils import save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import fully_shard

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    PartialState(cpu=True)
    model = fully_shard(_model())
    optimizer, scheduler = _objects(model)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    accelerator = types.SimpleNamespace(process_index=rank, num_processes=world)
    plugin = AcceleratePlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    save_fsdp_model(plugin, accelerator, model, root)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, root)
    random.seed(10 + rank)
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)
    save_accelerator_state(root, [], [], [scheduler], [], rank, step=5)
    full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    return full, scheduler.state_dict(), (random.random(), float(np.random.rand()), torch.rand(1).item())


def _fullshard_loads(rank: int, world: int, root: str) -> Any:
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # differs from what was saved
    optimizer, scheduler = _objects(model)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.load_state(root)
    draws = (random.random(), float(np.random.rand()), torch.rand(1).item())
    return accelerator.get_state_dict(model), scheduler.scheduler.state_dict(), draws


def test_accelerate_checkpoint_loads_with_numpy_rng_state(pool2: WorkerPool, tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    saved = run_on_ranks(_accelerate_saves, 2, str(tmp_path))
    loaded = pool2.run(_fullshard_loads, str(tmp_path))
    full, sched, _ = saved[0]
    model_sd, loaded_sched, _ = loaded[0]
    assert model_sd.keys() == full.keys() and all(torch.equal(model_sd[k], full[k]) for k in full)
    assert loaded_sched["last_epoch"] == sched["last_epoch"] and loaded_sched["_last_lr"] == sched["_last_lr"]
    for rank in range(2):  # every rank's python, numpy and torch generators continue as Accelerate's did
        assert loaded[rank][2] == saved[rank][2]

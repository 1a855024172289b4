"""A sharded model is freed once the user drops it: its unit states, parameters and flat buffers go with it.

Found on a GPU (docs/benchmarks.md, "On a GPU"): every fullshard model built in a process stayed allocated after
``del``, because a unit's state sat in a module-level ``WeakKeyDictionary`` whose value referred to its key, and
the post-accumulate-grad hook on a unit's full flat parameter (held from C++, out of the garbage collector's
sight) referred to its group. A second model in the same process (an evaluation copy, a sweep, a test) then paid
for the first. Each case trains a step (so the autograd graph, gradients, optimizer state and state dict hooks
all existed), drops the model and optimizer, and checks through weak references that nothing is left.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from fullshard import FSDP, Accelerator
from fullshard.engine.unit_state import unit_states_in
from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.testing.parity import fully_shard_blocks
from fullshard.wrap import ModuleWrapPolicy
from tests.distributed.test_accelerator import plugin

CFG = GPTConfig()


def _wrap(how: str, model: TinyGPT) -> Any:
    if how == "fully_shard":
        return fully_shard_blocks(model)
    return FSDP(model, sharding_strategy=how, auto_wrap_policy=ModuleWrapPolicy({Block}))


def dropped_leaves_nothing(rank: int, world: int, how: str) -> list[str]:
    """The names of the objects still alive after the model and optimizer were dropped (none expected)."""
    torch.manual_seed(0)
    accelerator = None
    if how.startswith("accelerator"):
        accelerator = Accelerator(fsdp_plugin=plugin(int(how[-1])))
        model = accelerator.prepare(TinyGPT(CFG))
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:
        model = _wrap(how, TinyGPT(CFG))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = make_batch(CFG, 2, rank)
    model(x, y).backward()
    optimizer.step()
    optimizer.zero_grad()
    model.state_dict()  # the state dict hooks ran
    states = unit_states_in(model)  # the root's, then each block's
    assert len(states) == CFG.n_layer + 1
    watched = {
        "model": weakref.ref(model),
        "a block's unit state": weakref.ref(states[1]),
        "its module": weakref.ref(states[1].module),
        "its flat shard": weakref.ref(states[1].group.flat_shard),
        "its full flat parameter": weakref.ref(states[1].group.flat_full),
        "optimizer": weakref.ref(optimizer),
    }
    if accelerator is not None:
        accelerator.free_memory()  # Accelerate's way to let go of what prepare() holds
    del model, optimizer, states
    gc.collect()
    return [name for name, ref in watched.items() if ref() is not None]


@pytest.mark.parametrize(
    "how", ["fully_shard", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "accelerator-v1", "accelerator-v2"]
)
def test_a_dropped_model_is_freed(pool2: WorkerPool, how: str) -> None:
    for alive in pool2.run(dropped_leaves_nothing, how):
        assert alive == [], f"still alive after del + gc.collect(): {alive}"

"""``estimate_memory`` predicts what a rank really holds, within 10%.

Set up: TinyGPT with one unit per block, sharded over 2 ranks, AdamW.
Run: one training step; measure on rank 0 the bytes of the flat shards, the sharded gradients' storage, the
optimizer states and the largest gathered buffer.
Check: the prediction from the parameter shapes alone (meta device, no process group) is within 10% of each.
"""

from __future__ import annotations

import pytest
import torch

from fullshard import FSDP
from fullshard.cli.memory_estimate import estimate_memory, unit_parameters
from fullshard.engine.api import ShardingStrategy
from fullshard.engine.unit_state import unit_states_in
from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.wrap import ModuleWrapPolicy

CFG = GPTConfig(vocab_size=61, block_size=9, n_layer=3, n_head=3, n_embd=21)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {}
    for t in tensors:
        local = t._local_tensor if hasattr(t, "_local_tensor") else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def measure(rank: int, world: int, strategy: str) -> dict[str, int]:
    torch.manual_seed(0)
    model = FSDP(TinyGPT(CFG), sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = make_batch(CFG, 2, seed=rank)
    model(x, y).backward()
    optimizer.step()
    groups = [s.group for s in unit_states_in(model) if s.group is not None]
    return {
        "params": sum(g.flat_shard.numel() * g.flat_shard.element_size() for g in groups),
        "grads": _storage_bytes([p.grad for p in model.parameters() if p.grad is not None]),
        "optimizer": sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()),
        "largest_unit": max(0 if g.alias_full else g.flat_full.numel() * g.flat_full.element_size() for g in groups),
    }


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_prediction_within_ten_percent_of_measured(pool2: WorkerPool, strategy: str) -> None:
    measured = pool2.run(measure, strategy)[0]
    with torch.device("meta"):
        units = unit_parameters(TinyGPT(CFG), {Block})
    predicted = estimate_memory(units, 2, ShardingStrategy[strategy])
    for key, value in measured.items():
        want = getattr(predicted, key)
        assert abs(want - value) <= 0.1 * max(value, 1), f"{key}: predicted {want} bytes, measured {value}"
    assert measured["params"] > 0 and measured["optimizer"] > 0

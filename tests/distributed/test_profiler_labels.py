"""Every engine phase shows up in a ``torch.profiler`` trace under its ``fullshard::`` label, once per occurrence."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fullshard import FSDP
from fullshard.engine import trace
from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.testing.parity import fully_shard_blocks
from fullshard.wrap import ModuleWrapPolicy

CFG = GPTConfig()  # 2 blocks: 3 units (the blocks and the root)


def _wrap(model: torch.nn.Module, entry: str) -> torch.nn.Module:
    if entry == "fully_shard":
        return fully_shard_blocks(model)
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=entry)


def _label_counts(rank: int, world: int, entry: str) -> dict[str, int]:
    torch.manual_seed(0)
    model = _wrap(TinyGPT(CFG), entry)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = make_batch(CFG, 2 * world, seed=0)
    x, y = x[rank * 2 : (rank + 1) * 2], y[rank * 2 : (rank + 1) * 2]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("fullshard::")}


def _expected(entry: str) -> dict[str, int]:
    blocks = CFG.n_layer
    units = blocks + 1
    # FULL_SHARD frees the blocks after forward and gathers them again in backward; the root stays gathered.
    # SHARD_GRAD_OP keeps every unit gathered from forward into backward.
    gathers = units + (0 if entry == "SHARD_GRAD_OP" else blocks)
    reshards = units + (0 if entry == "SHARD_GRAD_OP" else blocks)
    per_unit = (trace.PRE_FORWARD, trace.POST_FORWARD, trace.PRE_BACKWARD, trace.POST_BACKWARD)
    per_reduce = (trace.REDUCE_SCATTER, trace.COPY_IN, trace.REDUCE_WAIT)
    return {
        **dict.fromkeys(per_unit, units),
        **dict.fromkeys(per_reduce, units),
        **dict.fromkeys((trace.ALL_GATHER, trace.ALL_GATHER_WAIT, trace.COPY_OUT), gathers),
        trace.RESHARD: reshards,
        trace.FINAL_CALLBACK: 1,
    }


@pytest.mark.parametrize("entry", ["FULL_SHARD", "SHARD_GRAD_OP", "fully_shard"])
def test_every_phase_is_labelled_once_per_occurrence(pool2: WorkerPool, entry: str) -> None:
    expected = _expected(entry)
    assert set(expected) == set(trace.LABELS)
    for counts in pool2.run(_label_counts, entry):
        assert counts == expected

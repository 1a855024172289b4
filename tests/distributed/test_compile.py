"""``torch.compile`` composes with both entry points, as with torch FSDP2.

Set up: TinyGPT on 2 gloo ranks, 3 AdamW steps; compiled with the ``aot_eager`` backend (dynamo and AOT
autograd as with inductor, without generating kernels, so that the test runs in seconds on a CPU).
Run: each block compiled then ``fully_shard``ed; ``fully_shard`` then each block compiled; the whole sharded
model compiled; ``torch.compile`` of a ``FullyShardedDataParallel``-wrapped model; each against torch FSDP2
compiled the same way (where torch has that entry point) and against fullshard's eager run.
Check: losses and final parameters equal (aot_eager runs the same aten ops as eager, so to the last bit); the
engine's hooks run outside the compiled graphs (before, dynamo traced into them and failed at gloo's send);
per-block compilation gives no more graphs and no more graph breaks (dynamo's counters) than torch FSDP2's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from fullshard.engine.summon import summon_full_params
from fullshard.testing import WorkerPool
from fullshard.testing.parity import TrainSpec

SPEC = TrainSpec(optimizer="adamw", steps=3)
BACKEND = "aot_eager"


def train_compiled(rank: int, world: int, system: str, order: str) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = SPEC.model()
    if system == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fullshard import FullyShardedDataParallel, fully_shard
        from fullshard.wrap import ModuleWrapPolicy
    if order == "compile_then_shard":
        for block in model.blocks:
            block.compile(backend=BACKEND)
    if system == "ours_FSDP":
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])}))
    else:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    if order == "shard_then_compile":
        for block in model.blocks:
            block.compile(backend=BACKEND)
    optimizer = SPEC.make_optimizer(model.parameters())
    runnable = torch.compile(model, backend=BACKEND) if order == "whole" else model
    per = SPEC.batch // world
    losses = []
    for step in range(SPEC.steps):
        ((x, y),) = SPEC.micro_batches(step)
        loss = runnable(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    dist.barrier()
    if system == "torch":
        final = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    else:
        with summon_full_params(model, writeback=False):
            final = {n: p.detach().clone() for n, p in model.named_parameters()}
    breaks = sum(counters["graph_break"].values())
    return {"losses": losses, "final": final, "graphs": counters["stats"]["unique_graphs"], "breaks": breaks}


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert torch.equal(torch.stack(got["losses"]), torch.stack(want["losses"]))
    assert got["final"].keys() == want["final"].keys()
    for name, value in want["final"].items():
        assert torch.equal(got["final"][name], value), name


@pytest.mark.parametrize("order", ["compile_then_shard", "shard_then_compile", "whole"])
def test_fully_shard_compiled_matches_torch_fsdp2_compiled_and_eager(pool2: WorkerPool, order: str) -> None:
    ours = pool2.run(train_compiled, "ours", order)
    theirs = pool2.run(train_compiled, "torch", order)
    eager = pool2.run(train_compiled, "ours", "eager")
    for rank in range(2):
        _assert_same(ours[rank], theirs[rank])
        _assert_same(ours[rank], eager[rank])
        if order != "whole":  # one graph per block class, reused by every block; the hooks break no graph
            assert 0 < ours[rank]["graphs"] <= theirs[rank]["graphs"]
            assert ours[rank]["breaks"] <= theirs[rank]["breaks"]


def test_the_fsdp_class_compiled_whole_matches_eager(pool2: WorkerPool) -> None:
    compiled = pool2.run(train_compiled, "ours_FSDP", "whole")
    eager = pool2.run(train_compiled, "ours_FSDP", "eager")
    for rank in range(2):
        _assert_same(compiled[rank], eager[rank])
        assert compiled[rank]["graphs"] > 0

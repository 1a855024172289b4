"""Where ``fully_shard`` behaved differently from torch's, each seen in torch's own FSDP2 tests: a model sharded on
``meta`` loaded with ``load_state_dict(assign=True)``, the default mesh after the process group changed, a slice of
a sharded ``nn.Sequential``, and ``model.to(dtype)`` after sharding (for the FSDP class too, where the cast
parameters used to leave the unit's shards silently)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard import FSDP, FSDPModule, fully_shard
from fullshard.testing import WorkerPool
from fullshard.wrap import ModuleWrapPolicy


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def shard(model: nn.Sequential) -> nn.Sequential:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def assign_onto_meta(rank: int, world: int) -> dict[str, object]:
    """A sharded state dict loaded with ``assign=True`` into the same model sharded on ``meta``, then trained."""
    state = shard(build()).state_dict()
    with torch.device("meta"):
        model = shard(build())
    model.load_state_dict(state, assign=True)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    out = model(x)
    out.square().mean().backward()
    return {
        "error": (out - build()(x)).abs().max().item(),
        "meta": [n for n, p in model.named_parameters() if p.is_meta],
        "params": {n: p.full_tensor().detach() for n, p in model.named_parameters()},
        "grads": all(isinstance(p.grad, DTensor) for p in model.parameters()),
    }


def test_load_state_dict_assign_onto_meta_model(pool2: WorkerPool) -> None:
    want = dict(build().named_parameters())
    for rank, got in enumerate(pool2.run(assign_onto_meta)):
        assert not got["meta"], f"rank {rank}: still on meta after load_state_dict(assign=True): {got['meta']}"
        assert got["error"] < 1e-6, f"rank {rank}: output differs from the unsharded model's by {got['error']}"
        assert got["grads"], f"rank {rank}: a parameter got no sharded gradient"
        for name, value in want.items():
            torch.testing.assert_close(got["params"][name], value.detach(), msg=f"rank {rank} {name}")


def mesh_after_new_group(rank: int, world: int) -> list[int]:
    """``fully_shard`` without ``mesh=`` on 2 ranks; the default group then replaced by a 1-rank one on each rank,
    and ``fully_shard`` again: the second unit is on the new group, and trains."""
    sizes = [fully_shard(nn.Linear(3, 3)).weight.device_mesh.size()]
    dist.destroy_process_group()
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    model = fully_shard(nn.Linear(3, 3))
    model(torch.ones(2, 3)).sum().backward()
    sizes.append(model.weight.device_mesh.size())
    return sizes


def test_default_mesh_follows_the_process_group() -> None:
    pool = WorkerPool(2)  # its own: the function replaces the process group
    try:
        assert pool.run(mesh_after_new_group) == [[2, 1], [2, 1]]
    finally:
        pool.close()


def slice_of_sharded_sequential(rank: int, world: int) -> dict[str, object]:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3), nn.Linear(3, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    part = model[1:3]
    return {
        "part": (type(part).__name__, isinstance(part, FSDPModule), [type(m).__name__ for m in part]),
        "root": (type(model).__name__, isinstance(model, FSDPModule)),
    }


def test_slice_of_sharded_sequential_is_a_plain_sequential(pool2: WorkerPool) -> None:
    """Torch's behaviour: the slice is an ``nn.Sequential`` of the (still sharded) layers, not an ``FSDPModule``."""
    for got in pool2.run(slice_of_sharded_sequential):
        assert got["part"] == ("Sequential", False, ["ReLU", "FSDPLinear"])
        assert got["root"] == ("FSDPSequential", True)


def cast_after_sharding(rank: int, world: int, entry: str) -> dict[str, torch.Tensor]:
    """``model.to(torch.float64)`` on the root after sharding, then Adam steps on each rank's half of the batch."""
    model = build()
    if entry == "FSDP":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    else:
        shard(model)
    model = model.to(torch.float64)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        model(x[2 * rank : 2 * rank + 2]).square().mean().backward()
        optim.step()
        optim.zero_grad()
    if entry == "FSDP":
        with FSDP.summon_full_params(model):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("entry", ["fully_shard", "FSDP"])
def test_model_to_dtype_after_sharding_trains_in_that_dtype(pool2: WorkerPool, entry: str) -> None:
    model = build().to(torch.float64)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        model(
            torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        ).square().mean().backward()
        optim.step()
        optim.zero_grad()
    for rank, got in enumerate(pool2.run(cast_after_sharding, entry)):
        for name, value in model.named_parameters():
            assert got[name].dtype == torch.float64, f"rank {rank} {name}: {got[name].dtype}"
            torch.testing.assert_close(got[name], value.detach(), msg=f"rank {rank} {name}")

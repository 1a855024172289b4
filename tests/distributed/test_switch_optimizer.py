"""``fsdp2_switch_optimizer_parameters`` takes Accelerate's mapping as well as one keyed by parameters.

Accelerate (``Accelerator._prepare_fsdp2``) records each original parameter's ``data_ptr()`` before sharding,
swaps the optimizer's parameters for placeholders that carry that address as a ``data_ptr`` attribute, shards,
and switches with a mapping ``{data_ptr: sharded parameter}``. Checked: ours leaves the optimizer exactly as
Accelerate's own function does (same sharded parameter objects, same param groups and options), with
Accelerate's placeholders, with the original (now retired) parameters still in the optimizer, and with a
mapping keyed by the parameters, by their bound ``data_ptr`` methods (Accelerate looks keys up as
``mapping[p.data_ptr]``) or by a mix of those kinds; the switched optimizer then trains like the
single-process reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fullshard.engine.summon import summon_full_params
from fullshard.frontend.prepare import fsdp2_switch_optimizer_parameters
from fullshard.testing import RankFailure, WorkerPool
from fullshard.testing.parity import TrainSpec, fully_shard_blocks

SPEC = TrainSpec(optimizer="adamw")


def param_groups(model: nn.Module) -> list[dict[str, object]]:
    """Two groups with different options, as training scripts split decay and no-decay parameters."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def placeholders(optimizer: torch.optim.Optimizer) -> None:
    """What Accelerate does before sharding: stand-ins carrying the original parameters' addresses."""
    for group in optimizer.param_groups:
        for i, param in enumerate(group["params"]):
            group["params"][i] = torch.empty(1, dtype=param.dtype, device=param.device)
            group["params"][i].data_ptr = param.data_ptr()


def switch_like_accelerate(rank: int, world: int, keyed_by: str) -> dict[str, object]:
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters as accelerate_switch

    model = SPEC.model()
    addresses = {n: p.data_ptr() for n, p in model.named_parameters()}  # Accelerate's drop_refs names
    originals = dict(model.named_parameters())
    theirs = torch.optim.AdamW(param_groups(model), lr=SPEC.lr)
    ours_placeholders = torch.optim.AdamW(param_groups(model), lr=SPEC.lr)
    ours_originals = torch.optim.AdamW(param_groups(model), lr=SPEC.lr)
    placeholders(theirs)
    placeholders(ours_placeholders)
    fully_shard_blocks(model)
    sharded = dict(model.named_parameters())
    by_address = {addresses[n]: sharded[n] for n in sharded}
    accelerate_switch(theirs, by_address)
    fsdp2_switch_optimizer_parameters(ours_placeholders, by_address)
    if keyed_by == "address":
        fsdp2_switch_optimizer_parameters(ours_originals, by_address)
    elif keyed_by == "parameter":
        fsdp2_switch_optimizer_parameters(ours_originals, {originals[n]: sharded[n] for n in sharded})
    elif keyed_by == "data_ptr method":  # what Accelerate's own lookup, mapping[p.data_ptr], finds for a parameter
        fsdp2_switch_optimizer_parameters(ours_originals, {originals[n].data_ptr: sharded[n] for n in sharded})
    else:  # mixed: every third by address, every third by parameter, the rest by the bound data_ptr method
        kinds = (lambda n: addresses[n], lambda n: originals[n], lambda n: originals[n].data_ptr)
        mixed = {kinds[i % 3](n): sharded[n] for i, n in enumerate(sharded)}
        fsdp2_switch_optimizer_parameters(ours_originals, mixed)

    def layout(opt: torch.optim.Optimizer) -> list[tuple[list[int], float]]:
        return [([id(p) for p in g["params"]], g["weight_decay"]) for g in opt.param_groups]

    same = layout(theirs) == layout(ours_placeholders) == layout(ours_originals)
    all_sharded = {id(p) for g in theirs.param_groups for p in g["params"]} == {id(p) for p in sharded.values()}
    per = SPEC.batch // world
    for step in range(SPEC.steps):
        ((x, y),) = SPEC.micro_batches(step)
        model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
        ours_originals.step()
        ours_originals.zero_grad()
    dist.barrier()
    with summon_full_params(model, writeback=False):
        final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"same": same, "all_sharded": all_sharded, "final": final}


def reference() -> dict[str, torch.Tensor]:
    """Single process, full batch, the same two param groups."""
    model = SPEC.model()
    optimizer = torch.optim.AdamW(param_groups(model), lr=SPEC.lr)
    for step in range(SPEC.steps):
        ((x, y),) = SPEC.micro_batches(step)
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("keyed_by", ["address", "parameter", "data_ptr method", "mixed"])
def test_switch_matches_accelerate_and_trains(pool2: WorkerPool, keyed_by: str) -> None:
    want = reference()
    for got in pool2.run(switch_like_accelerate, keyed_by):
        assert got["same"] and got["all_sharded"]
        for name, value in want.items():
            torch.testing.assert_close(got["final"][name], value, atol=2e-5, rtol=1e-4, msg=name)


def switch_with_a_stranger(rank: int, world: int) -> None:
    model = SPEC.model()
    addresses = {n: p.data_ptr() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.ones(2))], lr=0.1)
    fully_shard_blocks(model)
    sharded = dict(model.named_parameters())
    fsdp2_switch_optimizer_parameters(optimizer, {addresses[n]: sharded[n] for n in sharded})


def test_a_parameter_missing_from_the_mapping_is_named(pool2: WorkerPool) -> None:
    named = r"parameter 28 of param group 0 \(a Parameter of dtype torch.float32\) has no sharded"
    with pytest.raises(RankFailure, match=named):
        pool2.run(switch_with_a_stranger)

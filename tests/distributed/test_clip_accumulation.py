"""Gradient clipping and gradient accumulation against an unsharded run of the same model and data.

Clipping: ``torch.nn.utils.clip_grad_norm_`` over ``fully_shard``'s ``DTensor`` parameters (as torch's FSDP2 users
clip), ``FSDPModule.clip_grad_norm_`` and the FSDP class's ``clip_grad_norm_``, on a 1-D mesh (2 ranks) and a 2-D
(HSDP, 2 x 2) one, norm types 2, 1 and inf: the total norm and the clipped gradients are the unsharded ones.
Accumulation: ``set_requires_gradient_sync(False)`` on every unit or on some (``recurse=False``), then a synced
micro-batch, with ``zero_grad(set_to_none=False)`` mixing accumulated and fresh gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fullshard import FSDP, fully_shard
from fullshard.testing import WorkerPool
from fullshard.wrap import ModuleWrapPolicy

DIM, ROWS, STEPS, MICRO = 9, 2, 3, 3


def mlp_stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM)) for _ in range(3)]
    )


def batch(step: int, world: int) -> torch.Tensor:
    return torch.randn(world * ROWS, DIM, generator=torch.Generator().manual_seed(1000 + step))


def rows(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


# --- clipping ---------------------------------------------------------------------------------------------


def clip_reference(world: int, norm_type: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = mlp_stack()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    norms = []
    for step in range(STEPS):
        model(batch(step, world)).sum().div(world).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type).item())
        optim.step()
        optim.zero_grad()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def clip_sharded(rank: int, world: int, how: str, norm_type: float, hsdp: bool) -> dict[str, object]:
    model = mlp_stack()
    if how == "FSDP":
        strategy = "HYBRID_SHARD" if hsdp else "FULL_SHARD"
        mesh = init_device_mesh("cpu", (2, world // 2)) if hsdp else None
        policy = ModuleWrapPolicy({nn.Linear})
        model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=strategy, device_mesh=mesh)
    elif how == "tp":  # dp x tp: each block's Linears split over tp, then sharded over dp
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        for block in model:
            parallelize_module(block, mesh["tp"], plan)
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        rank, world = mesh["dp"].get_local_rank(), 2  # the data-parallel rank takes its rows
    else:
        mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    norms = []
    for step in range(STEPS):
        model(rows(batch(step, world), rank, world)).sum().backward()
        if how in ("torch.nn.utils", "tp"):
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type)
        else:
            norm = model.clip_grad_norm_(0.5, norm_type)
        norms.append(_full(norm).item())
        optim.step()
        optim.zero_grad()
    if how == "FSDP":
        with FSDP.summon_full_params(model):
            params = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    else:
        params = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    return {"norms": norms, "params": params}


def check_clip(results: list[dict[str, object]], world: int, norm_type: float) -> None:
    norms, want = clip_reference(world, norm_type)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["norms"], norms, atol=1e-5, rtol=1e-5, msg=f"rank {rank} norms")
        for name, value in want.items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("how", ["torch.nn.utils", "FSDPModule", "FSDP"])
def test_clip_grad_norm_1d_matches_unsharded(pool2: WorkerPool, how: str, norm_type: float) -> None:
    check_clip(pool2.run(clip_sharded, how, norm_type, False), 2, norm_type)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("how", ["torch.nn.utils", "FSDPModule", "FSDP"])
def test_clip_grad_norm_hsdp_matches_unsharded(pool4: WorkerPool, how: str, norm_type: float) -> None:
    check_clip(pool4.run(clip_sharded, how, norm_type, True), 4, norm_type)


# --- accumulation -----------------------------------------------------------------------------------------


def accumulation_reference(world: int) -> dict[str, torch.Tensor]:
    model = mlp_stack()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        for micro in range(MICRO):
            model(batch(10 * step + micro, world)).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 1)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def accumulate_sharded(rank: int, world: int, which: str) -> dict[str, torch.Tensor]:
    """``which``: ``all`` (the root, recursively), ``some`` (the first two blocks, ``recurse=False``) or
    ``no_sync`` (the FSDP class)."""
    model = mlp_stack()
    if which == "no_sync":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    else:
        for block in model:
            fully_shard(block)
        fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        for micro in range(MICRO):
            last = micro == MICRO - 1
            if which == "all":
                model.set_requires_gradient_sync(last)
            elif which == "some":
                for block in model[:2]:
                    block.set_requires_gradient_sync(last, recurse=False)
            x = rows(batch(10 * step + micro, world), rank, world)
            if which == "no_sync" and not last:
                with model.no_sync():
                    model(x).square().mean().backward()
            else:
                model(x).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 1)
    if which == "no_sync":
        with FSDP.summon_full_params(model):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    return {n: _full(p).detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("which", ["all", "some", "no_sync"])
def test_gradient_accumulation_matches_unsharded(pool2: WorkerPool, which: str) -> None:
    want = accumulation_reference(2)
    for rank, got in enumerate(pool2.run(accumulate_sharded, which)):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_dp_tp_matches_unsharded(pool4: WorkerPool, norm_type: float) -> None:
    """``torch.nn.utils.clip_grad_norm_`` over a (dp, tp) model: the norm covers both mesh dimensions once."""
    check_clip(pool4.run(clip_sharded, "tp", norm_type, False), 2, norm_type)

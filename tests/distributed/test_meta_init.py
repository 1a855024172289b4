"""torchtitan's initialisation: build on ``meta``, ``fully_shard``, ``to_empty``, initialise in place, train.

``fully_shard`` leaves a meta-device model on meta (sharded DTensors with no storage), as torch's does; the
user's ``model.to_empty(device=...)`` then gives the shards storage and their own init writes the values.
Checked against torch's ``fully_shard`` doing the same (bitwise initial values, then training), against
single-process training from the same initial values, and, for an init that does not depend on sharding,
against the same init done on a model built on a real device. The FSDP1 wrapper keeps torch FSDP1's default:
meta modules are materialized with ``reset_parameters()`` at wrapping, in torch's order.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fullshard import FSDP, fully_shard
from fullshard.engine.unit_state import unit_state
from fullshard.frontend.prepare import fsdp2_load_full_state_dict
from fullshard.testing import RankFailure, WorkerPool
from fullshard.testing.models import TinyGPT
from fullshard.testing.parity import RunResult, TrainSpec, fully_shard_blocks, reference_run
from fullshard.wrap import ModuleWrapPolicy

SPEC = TrainSpec()


def reset_all(model: nn.Module) -> None:
    """``reset_parameters()`` on every module that has one (torchtitan's per-module pattern), under a fixed seed."""
    torch.manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        model.logit_scale.fill_(1.0)  # a bare parameter of the root: its module has no reset_parameters()


def init_weights(model: nn.Module) -> None:
    """A torchtitan-style ``init_weights`` whose values do not depend on sharding: each full tensor is drawn
    from one seeded generator and each rank keeps its rows (``distribute_tensor``)."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, param in model.named_parameters():
            full = torch.randn(param.shape, generator=generator) * 0.2
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements)
            param.copy_(full)


def shard_with(engine: str) -> Callable[..., nn.Module]:
    if engine == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard
    return fully_shard


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


def meta_init_then_train(rank: int, world: int, engine: str, init: str) -> dict[str, object]:
    shard = shard_with(engine)
    with torch.device("meta"):
        model = TinyGPT(SPEC.cfg)
    for block in model.blocks:
        shard(block)
    shard(model)
    params = list(model.parameters())
    left_on_meta = all(p.is_meta and isinstance(p, DTensor) for p in params)
    model.to_empty(device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DTensor's random ops on CPU warn that they run per shard
        reset_all(model) if init == "reset_parameters" else init_weights(model)
    initial = {n: _full(p) for n, p in model.named_parameters()}
    local_initial = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    opt = SPEC.make_optimizer(model.parameters())
    per = SPEC.batch // world
    losses = []
    for step in range(SPEC.steps):
        ((x, y),) = SPEC.micro_batches(step)
        loss = model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    final = {n: _full(p) for n, p in model.named_parameters()}
    return {"on_meta": left_on_meta, "initial": initial, "local": local_initial, "losses": losses, "final": final}


def reference_from(initial: dict[str, torch.Tensor]) -> RunResult:
    """Single-process training on the full batch, starting from ``initial``."""

    class FromInitial(TrainSpec):
        def model(self) -> TinyGPT:
            model = TinyGPT(self.cfg)
            model.load_state_dict(initial)
            return model

    return reference_run(FromInitial())


def assert_trained_like(got: dict[str, object], want: RunResult) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want.losses), atol=1e-5, rtol=1e-5)
    for name, ref in want.params.items():
        torch.testing.assert_close(got["final"][name], ref, atol=2e-5, rtol=1e-4, msg=name)


def test_reset_parameters_after_to_empty_matches_torch_fully_shard(pool2: WorkerPool) -> None:
    ours = pool2.run(meta_init_then_train, "fullshard", "reset_parameters")
    theirs = pool2.run(meta_init_then_train, "torch", "reset_parameters")
    for mine, peer in zip(ours, theirs):
        assert mine["on_meta"] and peer["on_meta"], "fully_shard must leave a meta model on meta"
        for name, value in peer["local"].items():
            assert torch.equal(mine["local"][name], value), name  # the same per-shard init, bit for bit
        torch.testing.assert_close(torch.tensor(mine["losses"]), torch.tensor(peer["losses"]), atol=1e-6, rtol=1e-6)
    want = reference_from(ours[0]["initial"])
    for got in ours:
        assert_trained_like(got, want)


def test_sharding_independent_init_matches_the_same_init_on_a_real_model(pool2: WorkerPool) -> None:
    real = TinyGPT(SPEC.cfg)
    init_weights(real)
    want = reference_from(real.state_dict())
    for got in pool2.run(meta_init_then_train, "fullshard", "init_weights"):
        for name, value in real.state_dict().items():
            assert torch.equal(got["initial"][name], value), name
        assert_trained_like(got, want)


def forward_on_meta(rank: int, world: int) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3))
    fully_shard(model)
    model(torch.ones(2, 4))


def test_forward_before_materializing_names_the_fix(pool2: WorkerPool) -> None:
    with pytest.raises(RankFailure) as info:
        pool2.run(forward_on_meta)
    assert sorted(info.value.failures) == [0, 1]
    message = "parameters still on the meta device at the first forward: ['<root Sequential>: 0.weight'"
    assert message in str(info.value)
    assert re.search(r"model\.to_empty\(device=\.\.\.\)", str(info.value))


def meta_then_to_cpu_values(rank: int, world: int) -> list[bool]:
    """``.to()`` to where the shards already are changes nothing (no new buffer, the same values)."""
    model = nn.Sequential(nn.Linear(4, 3))
    fully_shard(model)
    before = [p.to_local().detach().clone() for p in model.parameters()]
    flat = unit_state(model).group.flat_shard
    model.to("cpu")
    after = [p.to_local().detach() for p in model.parameters()]
    return [unit_state(model).group.flat_shard is flat] + [torch.equal(a, b) for a, b in zip(before, after)]


def test_to_same_device_keeps_the_shards(pool2: WorkerPool) -> None:
    for got in pool2.run(meta_then_to_cpu_values):
        assert all(got)


def load_full_into_meta(rank: int, world: int) -> dict[str, object]:
    """Accelerate's cpu_ram_efficient_loading order: shard on meta, then rank 0's full state dict is loaded."""
    full = SPEC.model().state_dict() if rank == 0 else {}
    with torch.device("meta"):
        model = TinyGPT(SPEC.cfg)
    fully_shard_blocks(model)
    fsdp2_load_full_state_dict(None, model, full)
    return {"state": {n: _full(p) for n, p in model.named_parameters()}}


def test_full_state_dict_loads_into_a_model_left_on_meta(pool2: WorkerPool) -> None:
    want = SPEC.model().state_dict()
    for got in pool2.run(load_full_into_meta):
        assert sorted(got["state"]) == sorted(want)
        for name, value in want.items():
            assert torch.equal(got["state"][name], value), name


# --- FSDP1: meta modules are materialized at wrapping, with reset_parameters() -------------------------


class Nested(nn.Module):
    """Several modules in one unit, so that the order reset_parameters() runs in shows in the values."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 6))
        self.outer = nn.Linear(6, 3)
        self.norm = nn.LayerNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.outer(self.inner(x)))


def fsdp1_meta_values(rank: int, world: int, engine: str, wrap_linear: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    with torch.device("meta"):
        model = Nested()
    policy_classes = {nn.Linear} if wrap_linear else None
    if engine == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

        policy = TorchPolicy(policy_classes) if policy_classes else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = TorchFSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True)
        with TorchFSDP.summon_full_params(wrapped):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in wrapped.named_parameters()}
    policy = ModuleWrapPolicy(policy_classes) if policy_classes else None
    wrapped = FSDP(model, auto_wrap_policy=policy)
    with FSDP.summon_full_params(wrapped):
        return {n: p.detach().clone() for n, p in wrapped.named_parameters()}


@pytest.mark.parametrize("wrap_linear", [False, True], ids=["one_unit", "unit_per_linear"])
def test_fsdp1_materializes_meta_modules_like_torch(pool2: WorkerPool, wrap_linear: bool) -> None:
    ours = pool2.run(fsdp1_meta_values, "fullshard", wrap_linear)
    theirs = pool2.run(fsdp1_meta_values, "torch", wrap_linear)
    for mine, peer in zip(ours, theirs):
        assert sorted(mine) == sorted(peer)
        for name, value in peer.items():
            assert torch.equal(mine[name], value), name

"""Sharded training equals single-process training on the full batch, for every strategy and entry point.

Set up: the same TinyGPT (uneven sizes, a one-element parameter) and the same global batches.
Run: N AdamW steps sharded over 2 ranks (hybrid: 4 as 2x2) and in one process.
Check: per-step losses and final gathered parameters agree within fp32 tolerance.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fullshard import FSDP, ShardingStrategy
from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, GPTConfig
from fullshard.testing.parity import RunResult, TrainSpec, fully_shard_blocks, reference_run, sharded_run
from fullshard.wrap import ModuleWrapPolicy

ATOL, RTOL = 2e-5, 1e-4


def assert_parity(got: RunResult, want: RunResult) -> None:
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), atol=1e-5, rtol=1e-5)
    assert got.params.keys() == want.params.keys()
    for name, ref in want.params.items():
        torch.testing.assert_close(got.params[name], ref, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
    if want.grad_norms:
        torch.testing.assert_close(torch.tensor(got.grad_norms), torch.tensor(want.grad_norms), atol=1e-5, rtol=1e-5)


# --- ways to shard a model (module level, so that they pickle to the ranks) ---------------------------


def wrap_fsdp(model: nn.Module, strategy: str, **kwargs: object) -> nn.Module:
    return FSDP(model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)


def wrap_fully_shard(model: nn.Module, reshard: bool, mesh_shape: tuple[int, ...] | None = None) -> nn.Module:
    mesh = init_device_mesh("cpu", mesh_shape) if mesh_shape else None
    return fully_shard_blocks(model, mesh=mesh, reshard_after_forward=reshard)


def wrap_fsdp_hybrid(model: nn.Module, strategy: str, how: str) -> nn.Module:
    if how == "auto":
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        return wrap_fsdp(model, strategy)
    if how == "mesh":
        return wrap_fsdp(model, strategy, device_mesh=init_device_mesh("cpu", (2, 2)))
    rank = dist.get_rank()
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = (shard_groups[rank // 2], replicate_groups[rank % 2])
    return wrap_fsdp(model, strategy, process_group=groups)


def run(rank: int, world: int, spec: TrainSpec, shard: functools.partial, no_sync: bool = False) -> RunResult:
    result = sharded_run(rank, world, spec, shard, use_no_sync=no_sync, clip=_clip if spec.clip else None)
    return result


def _clip(model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    if isinstance(model, FSDP):
        return model.clip_grad_norm_(max_norm, norm_type)
    from fullshard.engine.grad_norm import clip_grad_norm_
    from fullshard.engine.unit_state import unit_states_in

    return clip_grad_norm_(unit_states_in(model), [], max_norm, norm_type)


SPEC = TrainSpec()


@pytest.fixture(scope="module")
def reference() -> RunResult:
    return reference_run(SPEC)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_fsdp_strategies(pool2: WorkerPool, reference: RunResult, strategy: str) -> None:
    results = pool2.run(run, SPEC, functools.partial(wrap_fsdp, strategy=strategy))
    for result in results:
        assert_parity(result, reference)


@pytest.mark.parametrize(
    ("reshard", "mesh_shape"), [(True, None), (False, None), (True, (2, 1))], ids=["full", "grad_op", "no_shard"]
)
def test_fully_shard(pool2: WorkerPool, reference: RunResult, reshard: bool, mesh_shape: tuple | None) -> None:
    results = pool2.run(run, SPEC, functools.partial(wrap_fully_shard, reshard=reshard, mesh_shape=mesh_shape))
    for result in results:
        assert_parity(result, reference)


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
@pytest.mark.parametrize("how", ["auto", "groups", "mesh"])
def test_fsdp_hybrid_2x2(pool4: WorkerPool, reference: RunResult, strategy: str, how: str) -> None:
    results = pool4.run(run, SPEC, functools.partial(wrap_fsdp_hybrid, strategy=strategy, how=how))
    for result in results:
        assert_parity(result, reference)


@pytest.mark.parametrize("reshard", [True, False])
def test_fully_shard_hybrid_2x2(pool4: WorkerPool, reference: RunResult, reshard: bool) -> None:
    results = pool4.run(run, SPEC, functools.partial(wrap_fully_shard, reshard=reshard, mesh_shape=(2, 2)))
    for result in results:
        assert_parity(result, reference)


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "sync_each"])
@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_gradient_accumulation(pool2: WorkerPool, entry: str, no_sync: bool) -> None:
    spec = TrainSpec(accumulate=3)
    shard = (
        functools.partial(wrap_fsdp, strategy="FULL_SHARD")
        if entry == "fsdp"
        else functools.partial(wrap_fully_shard, reshard=True)
    )
    results = pool2.run(run, spec, shard, no_sync)
    want = reference_run(spec)
    for result in results:
        assert_parity(result, want)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_clip_grad_norm(pool2: WorkerPool, entry: str, norm_type: float) -> None:
    spec = TrainSpec(clip=0.05, clip_norm_type=norm_type)
    shard = (
        functools.partial(wrap_fsdp, strategy="FULL_SHARD")
        if entry == "fsdp"
        else functools.partial(wrap_fully_shard, reshard=True)
    )
    results = pool2.run(run, spec, shard)
    want = reference_run(spec)
    assert want.grad_norms[0] > spec.clip  # the clip really clips
    for result in results:
        assert_parity(result, want)


def test_tied_weights_in_one_unit(pool2: WorkerPool) -> None:
    spec = TrainSpec(cfg=GPTConfig(tie_weights=True))
    results = pool2.run(run, spec, functools.partial(wrap_fsdp, strategy="FULL_SHARD"))
    want = reference_run(spec)
    assert "head.weight" not in want.params  # named_parameters() reports a tied weight once
    for result in results:
        assert_parity(result, want)


def _strategy_of(rank: int, world: int, strategy: object) -> str:
    model = FSDP(nn.Linear(3, 3), sharding_strategy=strategy)
    return model.sharding_strategy.name


@pytest.mark.parametrize("given", ["full_shard", ShardingStrategy.FULL_SHARD, 1, "ShardingStrategy.FULL_SHARD"])
def test_strategy_spellings(pool2: WorkerPool, given: object) -> None:
    assert pool2.run(_strategy_of, given) == ["FULL_SHARD", "FULL_SHARD"]


def _torch_enum_strategy(rank: int, world: int) -> str:
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy  # a peer enum, accepted by name

    return FSDP(nn.Linear(3, 3), sharding_strategy=TorchStrategy.SHARD_GRAD_OP).sharding_strategy.name


def test_torch_enum_accepted(pool2: WorkerPool) -> None:
    assert pool2.run(_torch_enum_strategy) == ["SHARD_GRAD_OP", "SHARD_GRAD_OP"]


def _run_with_direct_gathers(rank: int, world: int, spec: TrainSpec, shard: functools.partial) -> RunResult:
    """Lower the threshold so that every large-enough parameter takes the direct (per-parameter) path."""
    from fullshard.engine import group

    previous = group.DIRECT_MIN_BYTES
    group.DIRECT_MIN_BYTES = 512  # bytes gathered: the matrices go direct, norms and biases stay packed
    try:
        return run(rank, world, spec, shard)
    finally:
        group.DIRECT_MIN_BYTES = previous


def _count_direct(rank: int, world: int) -> tuple[int, int]:
    from fullshard.engine import group
    from fullshard.engine.unit_state import unit_states_in

    previous = group.DIRECT_MIN_BYTES
    group.DIRECT_MIN_BYTES = 512
    try:
        model = wrap_fsdp(TrainSpec().model(), "FULL_SHARD")
    finally:
        group.DIRECT_MIN_BYTES = previous
    groups = [s.group for s in unit_states_in(model) if s.group is not None]
    return sum(len(g.direct) for g in groups), sum(len(g.packed) for g in groups)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_direct_per_parameter_gathers_keep_parity(pool2: WorkerPool, reference: RunResult, strategy: str) -> None:
    direct, packed = pool2.run(_count_direct)[0]
    assert direct > 0 and packed > 0  # both paths are exercised
    for result in pool2.run(_run_with_direct_gathers, SPEC, functools.partial(wrap_fsdp, strategy=strategy)):
        assert_parity(result, reference)


def test_direct_gathers_with_accumulation_and_bf16(pool2: WorkerPool) -> None:
    from fullshard import MixedPrecision

    spec = TrainSpec(accumulate=2)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard = functools.partial(wrap_fsdp, strategy="FULL_SHARD", mixed_precision=mp)
    bf16 = TrainSpec(accumulate=2, compute_dtype=torch.bfloat16, optimizer="sgd", lr=0.1)
    want = reference_run(spec)
    for result in pool2.run(_run_with_direct_gathers, spec, functools.partial(wrap_fsdp, strategy="FULL_SHARD")):
        assert_parity(result, want)
    want_bf16 = reference_run(bf16)
    for result in pool2.run(_run_with_direct_gathers, bf16, shard):
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(want_bf16.losses), atol=2e-2, rtol=1e-2)


def _torch_clip(model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)


def _run_with_torch_clip(rank: int, world: int, spec: TrainSpec) -> RunResult:
    return sharded_run(rank, world, spec, fully_shard_blocks, clip=_torch_clip)


def test_torch_clip_grad_norm_on_fully_shard_dtensors(pool2: WorkerPool) -> None:
    # torchtitan-style code clips with torch's own function: the DTensor gradients must give the global norm.
    spec = TrainSpec(clip=0.05)
    want = reference_run(spec)
    for result in pool2.run(_run_with_torch_clip, spec):
        assert_parity(result, want)

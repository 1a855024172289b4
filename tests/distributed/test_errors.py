"""Bad input gets a clear error, raised before anything is lost or a collective hangs; each message pinned."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fullshard import FSDP, fully_shard
from fullshard.testing import RankFailure, WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.wrap import ModuleWrapPolicy

# --- in this process: no process group exists here ----------------------------------------------------


def test_unknown_strategy_lists_valid_ones() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(
            "sharding_strategy='FULL_SHARDED' is not a ShardingStrategy; "
            "expected one of: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
            "HYBRID_SHARD, _HYBRID_SHARD_ZERO2."
        ),
    ):
        FSDP(nn.Linear(2, 2), sharding_strategy="FULL_SHARDED")


def test_unknown_backward_prefetch_lists_valid_ones() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(
            "backward_prefetch='BACKWARD_MID' is not a BackwardPrefetch; expected one of: BACKWARD_PRE, BACKWARD_POST."
        ),
    ):
        FSDP(nn.Linear(2, 2), backward_prefetch="BACKWARD_MID")


def test_policy_that_is_not_callable() -> None:
    with pytest.raises(TypeError, match=re.escape("ModuleWrapPolicy(module_classes=...) got 'Block'")):
        ModuleWrapPolicy({"Block"})


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_no_process_group_says_how_to_launch(entry: str) -> None:
    assert not dist.is_initialized()
    wrapper = FSDP if entry == "fsdp" else fully_shard
    name = "FullyShardedDataParallel" if entry == "fsdp" else "fully_shard"
    with pytest.raises(RuntimeError, match=re.escape(f"{name} needs an initialised process group")) as info:
        wrapper(nn.Linear(2, 2))
    assert "torchrun --nproc_per_node 2" in str(info.value)


def test_reshard_after_forward_must_be_bool_int_or_none() -> None:
    with pytest.raises(ValueError, match=re.escape("fully_shard(reshard_after_forward='yes'): pass True")):
        fully_shard(nn.Linear(2, 2), reshard_after_forward="yes")  # type: ignore[arg-type]


# --- on ranks -----------------------------------------------------------------------------------------


def _optimizer_before_wrapping(rank: int, world: int) -> None:
    model = TinyGPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model = FSDP(model)
    x, y = make_batch(model.cfg, 2, 0)
    model(x, y).backward()
    opt.step()


def test_optimizer_over_unsharded_parameters(pool2: WorkerPool) -> None:
    with pytest.raises(RankFailure) as info:
        pool2.run(_optimizer_before_wrapping)
    assert set(info.value.failures) == {0, 1}
    assert "AdamW.step(): 28 of its 28 parameters are the original, unsharded parameters" in str(info.value)
    assert "Create the optimizer after wrapping" in str(info.value)


def _call_submodule(rank: int, world: int, entry: str) -> None:
    model = TinyGPT(GPTConfig())
    if entry == "fsdp":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
        block = model.blocks[0].module
    else:
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        block = model.blocks[0]
    block.fc(torch.randn(2, 15))


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_submodule_called_directly(pool2: WorkerPool, entry: str) -> None:
    with pytest.raises(RankFailure) as info:
        pool2.run(_call_submodule, entry)
    text = str(info.value)
    assert "Linear at 'fc' was called directly, but its parameters belong to the sharded unit 'Block'" in text
    assert "summon_full_params" in text


def _ranks_differ(rank: int, world: int) -> None:
    cfg = GPTConfig(n_layer=2 if rank == 0 else 3)
    model = FSDP(TinyGPT(cfg), auto_wrap_policy=ModuleWrapPolicy({Block}))
    x, y = make_batch(cfg, 2, 0)
    model(x, y)


def test_ranks_with_different_models(pool2: WorkerPool) -> None:
    with pytest.raises(RankFailure) as info:
        pool2.run(_ranks_differ)
    assert set(info.value.failures) == {0, 1}  # every rank raises; none hangs
    assert "the sharded model differs across ranks: at module 'blocks.2', rank 1 has unit 'blocks.2'" in str(info.value)


def _tied_across_units(rank: int, world: int) -> None:
    model = TinyGPT(GPTConfig(tie_weights=True))
    model.wte = FSDP(model.wte)
    FSDP(model)


def test_tied_parameters_across_units(pool2: WorkerPool) -> None:
    with pytest.raises(RankFailure) as info:
        pool2.run(_tied_across_units)
    assert "parameter 'head.weight' is shared (tied) with a parameter that a unit below this one already" in str(
        info.value
    )


def _top_down(rank: int, world: int) -> None:
    model = TinyGPT(GPTConfig())
    fully_shard(model)
    fully_shard(model.blocks[0])


def test_fully_shard_top_down(pool2: WorkerPool) -> None:
    with pytest.raises(RankFailure) as info:
        pool2.run(_top_down)
    assert "parameter 'ln_1.weight' is already sharded by unit 'TinyGPT'. Shard bottom-up" in str(info.value)


def _summon_rank0_writeback(rank: int, world: int) -> None:
    model = FSDP(nn.Linear(3, 3))
    with FSDP.summon_full_params(model, rank0_only=True, writeback=True):
        pass


def test_summon_rank0_only_with_writeback(pool2: WorkerPool) -> None:
    with pytest.raises(RankFailure, match=re.escape("summon_full_params(writeback=True, rank0_only=True)")):
        pool2.run(_summon_rank0_writeback)

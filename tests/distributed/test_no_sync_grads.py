"""What ``.grad`` holds while gradient sync is off, and what the next synchronised backward makes of it.

Torch's FSDP1 (``use_orig_params=True``, which is what the wrapper's exposed original parameters are) shows
each parameter's local, unreduced gradient in the parameter's full shape inside ``no_sync()``, for every
strategy, and the next backward outside it averages the accumulation over ranks. Torch's ``fully_shard``
with ``set_requires_gradient_sync(False)`` keeps the accumulation out of sight (sharded ``.grad`` stays
``None``). Both entry points are checked against their torch peer (same model, data and values) and against
single-process accumulation of the same micro-batches.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard import FSDP, ShardingStrategy, fully_shard
from fullshard.testing import WorkerPool
from fullshard.wrap import ModuleWrapPolicy

MICRO_BATCHES = 3  # the first two inside no_sync, the last synchronised
PER_RANK = 2


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.Linear(3, 1))


def micro_batch(rank: int, index: int) -> torch.Tensor:
    return torch.randn(PER_RANK, 4, generator=torch.Generator().manual_seed(100 * rank + index))


def local_grads(rank: int) -> list[dict[str, torch.Tensor]]:
    """Single process: the accumulated gradient of ``rank``'s micro-batches after each of them."""
    model = make_model()
    seen = []
    for index in range(MICRO_BATCHES):
        model(micro_batch(rank, index)).square().mean().backward()
        seen.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return seen


def wrap(model: nn.Module, engine: str, strategy: str) -> nn.Module:
    if engine == "fullshard":
        policy = ModuleWrapPolicy({nn.Linear})
        return FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy[strategy])
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TorchFSDP(
            model,
            auto_wrap_policy=TorchPolicy({nn.Linear}),
            sharding_strategy=TorchStrategy[strategy],
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def fsdp1_accumulate(rank: int, world: int, engine: str, strategy: str) -> dict[str, object]:
    model = wrap(make_model(), engine, strategy)
    unsynced = []
    for index in range(MICRO_BATCHES - 1):
        with model.no_sync():
            model(micro_batch(rank, index)).square().mean().backward()
        unsynced.append({_clean(n): p.grad.clone() for n, p in model.named_parameters()})
    model(micro_batch(rank, MICRO_BATCHES - 1)).square().mean().backward()
    summon = FSDP.summon_full_params if engine == "fullshard" else type(model).summon_full_params
    with summon(model, with_grads=True):
        synced = {_clean(n): p.grad.clone() for n, p in model.named_parameters()}
    return {"unsynced": unsynced, "synced": synced}


@pytest.mark.parametrize("strategy", ["NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP"])
def test_fsdp1_no_sync_grads_match_torch_and_local_accumulation(pool2: WorkerPool, strategy: str) -> None:
    ours = pool2.run(fsdp1_accumulate, "fullshard", strategy)
    theirs = pool2.run(fsdp1_accumulate, "torch", strategy)
    local = [local_grads(rank) for rank in range(2)]
    average = {n: (local[0][-1][n] + local[1][-1][n]) / 2 for n in local[0][-1]}
    for rank, (mine, peer) in enumerate(zip(ours, theirs)):
        for step, (got, want) in enumerate(zip(mine["unsynced"], peer["unsynced"])):
            assert sorted(got) == sorted(want)
            for name, value in want.items():
                assert got[name].shape == value.shape == local[rank][step][name].shape, name
                torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-6, msg=f"rank {rank} {name}")
                torch.testing.assert_close(got[name], local[rank][step][name], atol=1e-6, rtol=1e-6, msg=name)
        for name, value in average.items():
            torch.testing.assert_close(mine["synced"][name], value, atol=1e-6, rtol=1e-6, msg=name)
            torch.testing.assert_close(mine["synced"][name], peer["synced"][name], atol=1e-6, rtol=1e-6, msg=name)


def zero_grad_inside_no_sync(rank: int, world: int) -> dict[str, torch.Tensor]:
    """``zero_grad()`` after an unsynchronised backward drops that accumulation (as it does in torch)."""
    model = wrap(make_model(), "fullshard", "FULL_SHARD")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.no_sync():
        model(micro_batch(rank, 0)).square().mean().backward()
    opt.zero_grad()
    model(micro_batch(rank, 1)).square().mean().backward()
    with FSDP.summon_full_params(model, with_grads=True):
        return {_clean(n): p.grad.clone() for n, p in model.named_parameters()}


def test_zero_grad_after_no_sync_drops_the_accumulation(pool2: WorkerPool) -> None:
    got = pool2.run(zero_grad_inside_no_sync)[0]
    only_second = []
    for rank in range(2):
        model = make_model()
        model(micro_batch(rank, 1)).square().mean().backward()
        only_second.append({n: p.grad for n, p in model.named_parameters()})
    for name, value in got.items():
        torch.testing.assert_close(value, (only_second[0][name] + only_second[1][name]) / 2, msg=name)


def fsdp2_accumulate(rank: int, world: int, engine: str) -> dict[str, object]:
    if engine == "fullshard":
        shard = fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as shard
    model = make_model()
    for layer in (model[0], model[2], model[3]):
        shard(layer)
    shard(model)
    model.set_requires_gradient_sync(False)
    hidden = []
    for index in range(MICRO_BATCHES - 1):
        model(micro_batch(rank, index)).square().mean().backward()
        hidden.append([p.grad is None for p in model.parameters()])
    model.set_requires_gradient_sync(True)
    model(micro_batch(rank, MICRO_BATCHES - 1)).square().mean().backward()
    synced = {n: p.grad.full_tensor() for n, p in model.named_parameters() if isinstance(p.grad, DTensor)}
    dist.barrier()
    return {"hidden": hidden, "synced": synced}


def test_fully_shard_gradient_sync_off_matches_torch(pool2: WorkerPool) -> None:
    ours = pool2.run(fsdp2_accumulate, "fullshard")
    theirs = pool2.run(fsdp2_accumulate, "torch")
    local = [local_grads(rank) for rank in range(2)]
    average = {n: (local[0][-1][n] + local[1][-1][n]) / 2 for n in local[0][-1]}
    for mine, peer in zip(ours, theirs):
        assert mine["hidden"] == peer["hidden"] == [[True] * 6] * (MICRO_BATCHES - 1)
        assert sorted(mine["synced"]) == sorted(average)
        for name, value in average.items():
            torch.testing.assert_close(mine["synced"][name], value, atol=1e-6, rtol=1e-6, msg=name)
            torch.testing.assert_close(mine["synced"][name], peer["synced"][name], atol=1e-6, rtol=1e-6, msg=name)

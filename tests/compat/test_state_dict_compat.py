"""State dicts against torch's own FSDP: same keys, placements and shards, and each loads the other's.

Set up: the same TinyGPT init sharded by fullshard's ``fully_shard`` and by torch's (FSDP2) on 2 gloo ranks
(torch's FSDP1 needs an accelerator, so it is not compared here).
Check: sharded model state dicts agree key by key (DTensor placements, local shards bitwise); optimizer
state dicts have the same structure, and torch's load into ours; our wrapper takes torch's enums and configs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fullshard
from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, TinyGPT, make_batch
from fullshard.wrap import ModuleWrapPolicy


def _make() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x, y = make_batch(model.cfg, 4, seed=1)
    rank = dist.get_rank()
    model(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]).backward()
    opt.step()
    opt.zero_grad()


def _describe(state: dict[str, Any]) -> dict[str, Any]:
    def one(v: Any) -> Any:
        if isinstance(v, DTensor):
            return ("dtensor", tuple(v.shape), str(tuple(v.placements)), v.to_local().clone())
        return ("tensor", tuple(v.shape), None, v.clone()) if isinstance(v, torch.Tensor) else ("value", v)

    return {k: one(v) for k, v in state.items()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if list(a) != list(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if x[:3] != y[:3] or (x[0] != "value" and not torch.equal(x[3], y[3])):
            return False
    return True


def _fsdp2(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    # - Set up: the same model under both fully_shard's, one AdamW step each
    ours, theirs = _make(), _make()
    for ours_block, their_block in zip(ours.blocks, theirs.blocks):
        fullshard.fully_shard(ours_block)
        torch_fully_shard(their_block)
    fullshard.fully_shard(ours)
    torch_fully_shard(theirs)
    same_init = _same(_describe(ours.state_dict()), _describe(theirs.state_dict()))
    ours_opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    _step(ours, ours_opt)
    _step(theirs, their_opt)
    # - Run: optimizer state dicts of each (ours: the fully_shard default, sharded)
    ours_osd = fullshard.FSDP.optim_state_dict(ours, ours_opt)
    their_osd = get_optimizer_state_dict(theirs, their_opt)
    structure = {
        fqn: {n: (type(v).__name__, tuple(v.shape), str(getattr(v, "placements", ""))) for n, v in s.items()}
        for fqn, s in ours_osd["state"].items()
    }
    their_structure = {
        fqn: {n: (type(v).__name__, tuple(v.shape), str(getattr(v, "placements", ""))) for n, v in s.items()}
        for fqn, s in their_osd["state"].items()
    }
    # - Run: theirs into ours (model and optimizer), then compare the model state dicts
    ours.load_state_dict(theirs.state_dict())
    ours_opt.load_state_dict(fullshard.FSDP.optim_state_dict_to_load(ours, ours_opt, their_osd))
    loaded = _same(_describe(ours.state_dict()), _describe(theirs.state_dict()))
    exp_avg = ours_opt.state[ours.wte.weight]["exp_avg"].to_local()
    their_exp_avg = their_opt.state[theirs.wte.weight]["exp_avg"].to_local()
    return {
        "same_init": same_init,
        "structure": structure == their_structure,
        "groups": [g["params"] for g in ours_osd["param_groups"]] == [g["params"] for g in their_osd["param_groups"]],
        "loaded": loaded,
        "optim_loaded": torch.equal(exp_avg, their_exp_avg),
    }


def test_fully_shard_state_dicts_match_torch_fsdp2(pool2: WorkerPool) -> None:
    for result in pool2.run(_fsdp2):
        assert result == {"same_init": True, "structure": True, "groups": True, "loaded": True, "optim_loaded": True}


def _torch_enums_and_configs(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FullStateDictConfig, ShardedStateDictConfig, StateDictType

    model = fullshard.FSDP(_make(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    config = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
    fullshard.FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, config)  # torch's enum and config
    full = model.state_dict()
    previous = fullshard.FSDP.set_state_dict_type(
        model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=True)
    )
    now = fullshard.FSDP.get_state_dict_type(model)
    want = _make().state_dict()
    return {
        "full": (list(full) == list(want) and all(torch.equal(full[k], want[k]) for k in want)) if rank == 0 else full,
        "previous": previous.state_dict_config,
        "now": (now.state_dict_type, now.state_dict_config),
    }


def test_wrapper_takes_torch_enums_and_configs(pool2: WorkerPool) -> None:
    rank0, rank1 = pool2.run(_torch_enums_and_configs)
    assert rank0["full"] is True and rank1["full"] == {}  # rank0_only came through torch's config
    for result in (rank0, rank1):
        assert result["previous"] == fullshard.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        assert result["now"] == (
            fullshard.StateDictType.SHARDED_STATE_DICT,
            fullshard.ShardedStateDictConfig(offload_to_cpu=True),
        )

"""Optimizer state dicts: every method round-trips exactly, matches the unwrapped optimizer, and reshards.

Set up: TinyGPT (tied weights, uneven sizes) sharded on 2 ranks through both entry points; Adam, AdamW,
SGD with momentum, AdamW with two param groups of different hyperparameters, and AdamW with an empty group.
Run: K steps, save the model (FULL) and the optimizer through one of the methods, build a fresh model and
optimizer from other weights, load both, train M more steps.
Check: the loaded optimizer holds bitwise the state the saved one had, and the losses equal bitwise those
of a run that never stopped. Across layouts (2 ranks -> 4, sharded <-> unwrapped) they agree with a
single-process reference within fp32 tolerance.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fullshard import (
    FSDP,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    OptimStateKeyType,
    StateDictType,
)
from fullshard.testing import RankFailure, WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.testing.parity import fully_shard_blocks
from fullshard.wrap import ModuleWrapPolicy

CFG = GPTConfig(tie_weights=True)
BATCH, K, M = 8, 2, 2


def make(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(CFG)


def shard(model: nn.Module, entry: str) -> nn.Module:
    if entry == "fsdp":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    if entry == "hybrid":  # 4 ranks: shard over 2, replicate over 2
        mesh = init_device_mesh("cpu", (2, 2))
        return FSDP(
            model, sharding_strategy="HYBRID_SHARD", device_mesh=mesh, auto_wrap_policy=ModuleWrapPolicy({Block})
        )
    return fully_shard_blocks(model)


def make_optim(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "empty_group":  # as transformers' Trainer builds it when no parameter takes weight decay
        groups = [{"params": [], "weight_decay": 0.1}, {"params": list(model.parameters()), "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-2)
    named = list(model.named_parameters())
    decay = [p for n, p in named if n.endswith("weight") and "ln" not in n]
    rest = [p for n, p in named if not (n.endswith("weight") and "ln" not in n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}]
    return torch.optim.AdamW(groups, lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, start: int, n: int) -> list[float]:
    """Steps ``start .. start + n - 1`` on this rank's slice of each global batch (all of it unsharded)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if _is_sharded(model) else (0, 1)
    per = BATCH // world
    losses = []
    for step in range(start, start + n):
        x, y = make_batch(CFG, BATCH, seed=step)
        loss = model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDP) or any(isinstance(p, DTensor) for p in model.parameters())


def full_model_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        return model.state_dict()


def local_copy(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's own state dict with every tensor as a fresh local copy (for exact comparison)."""
    osd = opt.state_dict()

    def copy(v: Any) -> Any:
        return (v.to_local() if isinstance(v, DTensor) else v).clone() if isinstance(v, torch.Tensor) else v

    return {
        "state": {i: {k: copy(v) for k, v in s.items()} for i, s in osd["state"].items()},
        "groups": osd["param_groups"],
    }


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["groups"] != b["groups"] or list(a["state"]) != list(b["state"]):
        return False
    for i, state in a["state"].items():
        other = b["state"][i]
        if list(state) != list(other):
            return False
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and not (v.dtype == other[k].dtype and torch.equal(v, other[k])):
                return False
            if not isinstance(v, torch.Tensor) and v != other[k]:
                return False
    return True


# --- the methods: save on the trained model, load into the fresh one --------------------------------


def _settings(model: nn.Module, kind: str, rank0_only: bool = False) -> None:
    optim_config = FullOptimStateDictConfig(rank0_only=rank0_only) if kind == "FULL_STATE_DICT" else None
    FSDP.set_state_dict_type(model, kind, None, optim_config)


def save(method: str, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    if method.startswith("optim_state_dict:"):
        kind = method.split(":")[1]
        _settings(model, kind.removesuffix("+rank0"), rank0_only=kind.endswith("+rank0"))
        return FSDP.optim_state_dict(model, opt)
    if method in ("shard_full", "rekey"):
        return FSDP.full_optim_state_dict(model, opt, rank0_only=False)
    if method == "scatter_full":
        return FSDP.full_optim_state_dict(model, opt)  # rank0_only=True: {} elsewhere
    return FSDP.sharded_optim_state_dict(model, opt)


def load(method: str, model: nn.Module, opt: torch.optim.Optimizer, saved: Any) -> None:
    if method.startswith("optim_state_dict:"):
        kind = method.split(":")[1]
        _settings(model, kind.removesuffix("+rank0"), rank0_only=kind.endswith("+rank0"))
        FSDP.optim_state_dict_to_load(model, opt, saved, load_directly=True)
        return
    if method == "shard_full":
        opt.load_state_dict(FSDP.shard_full_optim_state_dict(saved, model, optim=opt))
    elif method == "rekey":
        by_id = FSDP.rekey_optim_state_dict(saved, OptimStateKeyType.PARAM_ID, model)
        assert all(isinstance(k, int) for k in by_id["state"])
        by_name = FSDP.rekey_optim_state_dict(by_id, "PARAM_NAME", model)
        opt.load_state_dict(FSDP.shard_full_optim_state_dict(by_name, model))  # groups taken from the dict
    elif method == "scatter_full":
        opt.load_state_dict(FSDP.scatter_full_optim_state_dict(saved or None, model, optim=opt))
    else:
        opt.load_state_dict(FSDP.flatten_sharded_optim_state_dict(saved, model, opt))


def _resume(rank: int, world: int, entry: str, kind: str, method: str) -> dict[str, Any]:
    # - Set up / Run: an uninterrupted run of K + M steps
    model = shard(make(), entry)
    opt = make_optim(model, kind)
    uninterrupted = train(model, opt, 0, K + M)
    # - Run: K steps, save, load into a fresh model and optimizer built from other weights, M more steps
    model = shard(make(), entry)
    opt = make_optim(model, kind)
    train(model, opt, 0, K)
    before = local_copy(opt)
    weights = full_model_dict(model)
    saved = save(method, model, opt)
    model = shard(make(seed=9), entry)
    opt = make_optim(model, kind)
    model.load_state_dict(weights)
    load(method, model, opt, saved)
    after = local_copy(opt)
    resumed = train(model, opt, K, M)
    # - Check (in the test): exact state, exact losses
    return {"exact_state": same_state(before, after), "resumed": resumed, "want": uninterrupted[K:]}


METHODS = [
    "optim_state_dict:FULL_STATE_DICT",
    "optim_state_dict:FULL_STATE_DICT+rank0",
    "optim_state_dict:SHARDED_STATE_DICT",
    "optim_state_dict:LOCAL_STATE_DICT",
    "shard_full",
    "scatter_full",
    "sharded_flatten",
    "rekey",
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_each_method_round_trips_exactly(pool2: WorkerPool, entry: str, method: str) -> None:
    for result in pool2.run(_resume, entry, "two_groups", method):
        assert result["exact_state"]
        assert result["resumed"] == result["want"]  # bitwise: training continues as if never stopped


@pytest.mark.parametrize("method", ["optim_state_dict:FULL_STATE_DICT+rank0", "optim_state_dict:SHARDED_STATE_DICT"])
def test_hybrid_2x2_round_trips_exactly(pool4: WorkerPool, method: str) -> None:
    for result in pool4.run(_resume, "hybrid", "two_groups", method):
        assert result["exact_state"] and result["resumed"] == result["want"]


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_each_optimizer_round_trips_exactly(pool2: WorkerPool, entry: str, kind: str) -> None:
    for result in pool2.run(_resume, entry, kind, "optim_state_dict:FULL_STATE_DICT"):
        assert result["exact_state"] and result["resumed"] == result["want"]


@pytest.mark.parametrize("method", ["scatter_full", "optim_state_dict:FULL_STATE_DICT+rank0"])
def test_an_empty_param_group_round_trips_exactly(pool2: WorkerPool, method: str) -> None:
    # The Trainer's FULL_STATE_DICT checkpoints: its weight-decay group is empty with weight_decay=0
    for result in pool2.run(_resume, "fsdp", "empty_group", method):
        assert result["exact_state"] and result["resumed"] == result["want"]


# --- against the unwrapped optimizer, and across layouts ----------------------------------------------


def reference(kind: str, steps: int) -> tuple[TinyGPT, torch.optim.Optimizer, list[float]]:
    model = make()
    opt = make_optim(model, kind)
    return model, opt, train(model, opt, 0, steps)


def _save_after_k(rank: int, world: int, entry: str, kind: str) -> Any:
    model = shard(make(), entry)
    opt = make_optim(model, kind)
    train(model, opt, 0, K)
    FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True))
    weights = model.state_dict()
    full = FSDP.full_optim_state_dict(model, opt)  # rank0_only=True by default
    sharded = FSDP.sharded_optim_state_dict(model, opt)
    shapes = {
        fqn: {k: (tuple(v.shape), str(v.placements)) for k, v in s.items() if v.dim()}
        for fqn, s in sharded["state"].items()
    }
    return (weights, full, shapes) if rank == 0 else (weights, full, None)


def assert_close_osd(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert list(got["state"]) == list(want["state"])
    for fqn, state in want["state"].items():
        assert list(got["state"][fqn]) == list(state)
        for k, v in state.items():
            torch.testing.assert_close(got["state"][fqn][k], v, atol=1e-6, rtol=1e-4, msg=f"{fqn}.{k}")


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_full_dict_matches_the_unwrapped_optimizer(pool2: WorkerPool, entry: str) -> None:
    # - Set up / Run: K sharded steps on 2 ranks; K unwrapped steps in this process
    (_, full, shapes), (empty_weights, empty, _) = pool2.run(_save_after_k, entry, "two_groups")
    model, opt, _ = reference("two_groups", K)
    want = FSDP.rekey_optim_state_dict(opt.state_dict(), OptimStateKeyType.PARAM_NAME, model, optim=opt)
    # - Check: same names (tied once), groups and hyperparameters; values within fp32 tolerance
    assert empty_weights == {} and empty == {}
    assert "head.weight" not in full["state"] and "wte.weight" in full["state"]
    assert_close_osd(full, want)
    assert shapes["blocks.0.fc.weight"]["exp_avg"] == ((61, 15), "(Shard(dim=0),)")


def test_sharded_model_state_loads_into_unwrapped_model_and_back(pool2: WorkerPool) -> None:
    # - Set up: K steps sharded (rank 0's full dicts) and the uninterrupted reference
    weights, full, _ = pool2.run(_save_after_k, "fsdp", "adamw")[0]
    _, _, want = reference("adamw", K + M)
    # - Run: wrapped -> unwrapped (re-keyed by ids), M more steps in one process
    model = make(seed=9)
    opt = make_optim(model, "adamw")
    model.load_state_dict(weights)
    opt.load_state_dict(FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, model))
    losses = train(model, opt, K, M)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want[K:]), atol=1e-5, rtol=1e-5)
    # - Run: unwrapped -> wrapped (re-keyed by names), M more steps on 2 ranks
    ref_model, ref_opt, _ = reference("adamw", K)
    by_name = FSDP.rekey_optim_state_dict(ref_opt.state_dict(), OptimStateKeyType.PARAM_NAME, ref_model)
    for result in pool2.run(_continue, "fsdp", "adamw", ref_model.state_dict(), by_name, "shard"):
        torch.testing.assert_close(torch.tensor(result), torch.tensor(want[K:]), atol=1e-5, rtol=1e-5)


def _continue(rank: int, world: int, entry: str, kind: str, weights: Any, full: Any, how: str) -> list[float]:
    model = shard(make(seed=9), entry)
    opt = make_optim(model, kind)
    model.load_state_dict(weights)
    if how == "scatter":
        opt.load_state_dict(FSDP.scatter_full_optim_state_dict(full if rank == 0 else None, model, optim=opt))
    else:
        opt.load_state_dict(FSDP.shard_full_optim_state_dict(full, model, optim=opt))
    return train(model, opt, K, M)


@pytest.mark.parametrize("how", ["shard", "scatter"])
@pytest.mark.parametrize(("source", "target"), [("fsdp", "fsdp"), ("fully_shard", "fully_shard"), ("fsdp", "hybrid")])
def test_reshard_2_to_4_ranks_and_train_on(
    pool2: WorkerPool, pool4: WorkerPool, source: str, target: str, how: str
) -> None:
    # - Set up: K steps on 2 ranks; rank 0 holds the full model and optimizer state dicts
    weights, full, _ = pool2.run(_save_after_k, source, "two_groups")[0]
    _, _, want = reference("two_groups", K + M)
    # - Run / Check: 4 ranks (hybrid: 2 shards x 2 replicas) load them and train on like the reference
    for losses in pool4.run(_continue, target, "two_groups", weights, full, how):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want[K:]), atol=1e-5, rtol=1e-5)


# --- errors -------------------------------------------------------------------------------------------


def _misuse(rank: int, world: int, how: str) -> None:
    model = make()
    if how == "before_wrap":
        opt = make_optim(model, "adam")
        model = shard(model, "fsdp")
        FSDP.optim_state_dict(model, opt)
    model = shard(model, "fsdp")
    opt = make_optim(model, "adam")
    train(model, opt, 0, 1)
    full = FSDP.full_optim_state_dict(model, opt, rank0_only=False)
    if how == "by_id":
        FSDP.optim_state_dict_to_load(model, opt, opt.state_dict())
    elif how == "unknown":
        full["state"]["nope.weight"] = full["state"].pop("blocks.0.fc.weight")
        FSDP.optim_state_dict_to_load(model, opt, full)
    elif how == "rekey":
        FSDP.rekey_optim_state_dict({"state": {99: {}}, "param_groups": []}, "PARAM_NAME", model)
    elif how == "scatter_none":
        FSDP.scatter_full_optim_state_dict(None, model)
    elif how == "shape":
        full["state"]["blocks.0.fc.weight"]["exp_avg"] = torch.zeros(3, 3)
        FSDP.shard_full_optim_state_dict(full, model, optim=opt)
    elif how == "malformed":
        osd = opt.state_dict()
        osd["state"][0]["exp_avg"] = torch.zeros(3, 3)
        FSDP.optim_state_dict(model, opt, osd)
    elif how == "optim_input":
        FSDP.full_optim_state_dict(model, opt, optim_input=list(model.parameters()))
    elif how == "group":
        FSDP.sharded_optim_state_dict(model, opt, group=dist.new_group([0]))


ERRORS = {
    "before_wrap": "optim_state_dict: the optimizer holds the original parameters of a model that was sharded after",
    "by_id": "optim_state_dict_to_load: the optimizer state dict is keyed by parameter ids ([0, 1, 2, 3]...)",
    "unknown": "optim_state_dict_to_load: the optimizer state dict has state for ['nope.weight'], which are not",
    "rekey": "rekey_optim_state_dict: key 99 names no parameter of the model's 27 parameters (in optimizer order)",
    "scatter_none": "scatter_full_optim_state_dict(full_optim_state_dict=NoneType): rank 0 must pass the full",
    "shape": "optimizer state 'exp_avg' of 'blocks.0.fc.weight': the value has shape (3, 3) but the parameter has",
    "malformed": "ValueError: [rank 0] full_optim_state_dict: optimizer state of 'logit_scale' has shape (3, 3), but",
    "optim_input": "ValueError: FullyShardedDataParallel.full_optim_state_dict(optim_input=...) is not supported",
    "group": "ValueError: sharded_optim_state_dict(group=<process group of ranks [0]>): the sharded form uses the",
}


@pytest.mark.parametrize("how", list(ERRORS))
def test_misuse_raises_with_a_fix(pool2: WorkerPool, how: str) -> None:
    with pytest.raises(RankFailure, match=re.escape(ERRORS[how])) as failure:
        pool2.run(_misuse, how)
    assert sorted(failure.value.failures) == [0, 1]  # every rank raises: none is left waiting

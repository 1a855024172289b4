"""Model state dicts: FULL / SHARDED / LOCAL through both entry points, key names, loads both ways, errors.

Set up: a TinyGPT with tied weights, a batch norm (buffers, an int64 counter) and a persistent and a
non-persistent buffer, sharded on 2 ranks (hybrid: 4) with one unit per block plus the root.
Check: a FULL state dict equals the unwrapped model's bitwise (keys in order, values); SHARDED values are
DTensors whose full tensors equal it; every type round-trips; mismatches raise naming the keys.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fullshard import (
    FSDP,
    FullStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fullshard.testing import RankFailure, WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.testing.parity import fully_shard_blocks
from fullshard.wrap import ModuleWrapPolicy

CFG = GPTConfig(tie_weights=True)


class BufferedGPT(TinyGPT):
    """TinyGPT (tied) with buffers: a batch norm's, a persistent one and a non-persistent one."""

    def __init__(self) -> None:
        super().__init__(CFG)
        self.norm = nn.BatchNorm1d(7)
        self.register_buffer("pos_scale", torch.linspace(0.5, 1.5, CFG.block_size))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def make(seed: int = 0) -> BufferedGPT:
    torch.manual_seed(seed)
    model = BufferedGPT()
    with torch.no_grad():  # distinct buffer values, so that a mix-up shows
        model.norm.running_mean.uniform_()
        model.norm.num_batches_tracked.fill_(3 + seed)
    return model


def shard(model: nn.Module, entry: str, strategy: str = "FULL_SHARD", mesh_shape: tuple[int, ...] | None = None) -> Any:
    if entry == "fsdp":
        kwargs: dict[str, Any] = {"device_mesh": init_device_mesh("cpu", mesh_shape)} if mesh_shape else {}
        return FSDP(model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)
    mesh = init_device_mesh("cpu", mesh_shape) if mesh_shape else None
    return fully_shard_blocks(model, mesh=mesh)


def train_step(model: nn.Module, seed: int = 5) -> None:
    """One SGD step, so that parameters move away from what was saved."""
    x, y = make_batch(CFG, 2, seed)
    model(x, y).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
                p.grad = None


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same keys in the same order, bitwise-equal plain tensors of the same dtype."""
    if list(a) != list(b):
        return False
    return all(type(a[k]) is torch.Tensor and a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def full_dict(model: nn.Module, **config: bool) -> dict[str, Any]:
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(**config)):
        return model.state_dict()


# --- FULL -------------------------------------------------------------------------------------------


def _full_equals_unwrapped(rank: int, world: int, entry: str, strategy: str) -> dict[str, Any]:
    # - Set up: the sharded model and its unwrapped twin
    reference = make().state_dict()
    model = shard(make(), entry, strategy)
    # - Run: the FULL dict (the wrapper's default), loaded into an unwrapped model of other weights
    got = model.state_dict() if entry == "fsdp" else full_dict(model)
    other = make(seed=1)
    other.load_state_dict(got)
    return {"same": same(got, reference), "loaded": same(other.state_dict(), reference), "keys": list(got)}


@pytest.mark.parametrize(
    ("entry", "strategy"),
    [("fsdp", "FULL_SHARD"), ("fsdp", "SHARD_GRAD_OP"), ("fsdp", "NO_SHARD"), ("fully_shard", "FULL_SHARD")],
)
def test_full_state_dict_equals_unwrapped_bitwise(pool2: WorkerPool, entry: str, strategy: str) -> None:
    for result in pool2.run(_full_equals_unwrapped, entry, strategy):
        assert result["same"] and result["loaded"]
        assert "head.weight" in result["keys"] and "wte.weight" in result["keys"]  # tied: both names, as torch
        assert "scratch" not in result["keys"] and "norm.num_batches_tracked" in result["keys"]


def _rank0_only(rank: int, world: int, entry: str) -> dict[str, Any]:
    model = shard(make(), entry)
    got = full_dict(model, rank0_only=True, offload_to_cpu=True)
    devices = {v.device.type for v in got.values()}
    return {"n": len(got), "same": same(got, make().state_dict()), "devices": devices}


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_full_rank0_only_and_offload(pool2: WorkerPool, entry: str) -> None:
    rank0, rank1 = pool2.run(_rank0_only, entry)
    assert rank0["same"] and rank0["devices"] == {"cpu"}
    assert rank1["n"] == 0  # other ranks get an empty dict


def _unwrapped_into_sharded(rank: int, world: int, entry: str) -> bool:
    # - Set up: an unwrapped model with other weights and buffers; a sharded one
    source = make(seed=7)
    model = shard(make(), entry)
    # - Run: load the unwrapped model's own state dict (full tensors) whatever the type in force
    result = model.load_state_dict(source.state_dict())
    # - Check: nothing reported; the FULL dict is now the source's, bitwise; training still runs
    train_step(model)
    train_step(source)
    return not result.missing_keys and not result.unexpected_keys and same(full_dict(model), source.state_dict())


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_unwrapped_state_dict_loads_into_sharded_model(pool2: WorkerPool, entry: str) -> None:
    assert pool2.run(_unwrapped_into_sharded, entry) == [True, True]


def _mixed_precision(rank: int, world: int) -> dict[str, Any]:
    # - Set up: bf16 compute and buffers; a step casts the buffers (lazy init) and moves the fp32 shards
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(make(), auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp)
    train_step(model)
    # - Run: the FULL dict, and a round trip into another bf16 model
    got = model.state_dict()
    other = FSDP(make(seed=4), auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp)
    train_step(other)
    other.load_state_dict(got)
    return {
        "dtypes": {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in make().state_dict().items()},
        "buffer_cast": model.pos_scale.dtype == torch.bfloat16,
        "round_trip": same(other.state_dict(), got),
    }


def test_mixed_precision_saves_original_dtypes(pool2: WorkerPool) -> None:
    for result in pool2.run(_mixed_precision):
        assert result == {"dtypes": True, "buffer_cast": True, "round_trip": True}


# --- SHARDED ----------------------------------------------------------------------------------------


def _sharded(rank: int, world: int, entry: str, strategy: str, mesh_shape: tuple[int, ...] | None) -> dict[str, Any]:
    reference = make().state_dict()
    model = shard(make(), entry, strategy, mesh_shape)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        got = model.state_dict()
    params = {n for n, _ in make().named_parameters()} | {"head.weight"}
    placements = {str(tuple(v.placements)) for k, v in got.items() if k in params}
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in got.items()}
    return {
        "params_are_dtensors": all(isinstance(got[k], DTensor) for k in params),
        "buffers_are_plain": all(type(v) is torch.Tensor for k, v in got.items() if k not in params),
        "placements": placements,
        "same": same(full, reference),
    }


@pytest.mark.parametrize(
    ("entry", "strategy", "mesh_shape", "placements"),
    [
        ("fsdp", "FULL_SHARD", None, (Shard(0),)),
        ("fsdp", "NO_SHARD", None, (Replicate(),)),
        ("fully_shard", "", None, (Shard(0),)),
        ("fully_shard", "", (2, 1), (Replicate(), Shard(0))),
    ],
)
def test_sharded_values_are_dtensors_of_the_full_tensors(
    pool2: WorkerPool, entry: str, strategy: str, mesh_shape: tuple[int, ...] | None, placements: tuple
) -> None:
    for result in pool2.run(_sharded, entry, strategy or "FULL_SHARD", mesh_shape):
        assert result["params_are_dtensors"] and result["buffers_are_plain"] and result["same"]
        assert result["placements"] == {str(placements)}


def test_hybrid_2x2_sharded_and_full(pool4: WorkerPool) -> None:
    for result in pool4.run(_sharded, "fsdp", "HYBRID_SHARD", (2, 2)):
        assert result["same"] and result["placements"] == {str((Replicate(), Shard(0)))}


def _round_trip(rank: int, world: int, entry: str, kind: str) -> bool:
    # - Set up: save in `kind` (copies: SHARDED and LOCAL values are views of the live shards)
    model = shard(make(), entry)
    with FSDP.state_dict_type(model, kind):
        saved = {k: v.clone() for k, v in model.state_dict().items()}
    # - Run: move the weights and buffers away, then load what was saved
    train_step(model)
    with torch.no_grad():
        model.norm.running_mean.zero_()
    with FSDP.state_dict_type(model, kind):
        result = model.load_state_dict(saved)
    # - Check: the model is bitwise what it was
    return not result.missing_keys and not result.unexpected_keys and same(full_dict(model), make().state_dict())


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"])
@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_round_trip_each_type(pool2: WorkerPool, entry: str, kind: str) -> None:
    assert pool2.run(_round_trip, entry, kind) == [True, True]


def _local_keys(rank: int, world: int) -> dict[str, Any]:
    model = shard(make(), "fsdp")
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig()):
        got = model.state_dict()
    return {k: (tuple(v.to_local().shape), tuple(v.shape)) for k, v in got.items() if k.endswith("_flat_param")}


def test_local_state_dict_holds_each_units_flat_shard(pool2: WorkerPool) -> None:
    rank0, rank1 = pool2.run(_local_keys)
    assert list(rank0) == ["blocks.0._flat_param", "blocks.1._flat_param", "_flat_param"]
    for key, (local, global_shape) in rank0.items():
        assert rank1[key][0] == local and global_shape == (2 * local[0],)  # equal padded shards


def _dcp_save(rank: int, world: int, entry: str, path: str) -> None:
    model = shard(make(seed=3), entry)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict()}, checkpoint_id=path)


def _dcp_load(rank: int, world: int, entry: str, path: str) -> bool:
    model = shard(make(), entry)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
    return same(full_dict(model), make(seed=3).state_dict())


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_sharded_state_dict_reshards_through_dcp_2_to_4(
    pool2: WorkerPool, pool4: WorkerPool, tmp_path: Path, entry: str
) -> None:
    pool2.run(_dcp_save, entry, str(tmp_path / "ckpt"))
    assert pool4.run(_dcp_load, entry, str(tmp_path / "ckpt")) == [True] * 4


# --- settings ---------------------------------------------------------------------------------------


def _settings(rank: int, world: int) -> dict[str, Any]:
    fsdp_model = shard(make(), "fsdp")
    fs_model = shard(make(), "fully_shard")
    defaults = (FSDP.get_state_dict_type(fsdp_model), FSDP.get_state_dict_type(fs_model))
    previous = FSDP.set_state_dict_type(fsdp_model, "sharded_state_dict", ShardedStateDictConfig(offload_to_cpu=True))
    now = FSDP.get_state_dict_type(fsdp_model)
    with FSDP.state_dict_type(fsdp_model, StateDictType.LOCAL_STATE_DICT):
        inside = FSDP.get_state_dict_type(fsdp_model).state_dict_type
    after = FSDP.get_state_dict_type(fsdp_model)
    return {"defaults": defaults, "previous": previous, "now": now, "inside": inside, "after": after}


def test_set_get_and_context_manager(pool2: WorkerPool) -> None:
    result = pool2.run(_settings)[0]
    fsdp_default, fs_default = result["defaults"]
    assert fsdp_default.state_dict_type is StateDictType.FULL_STATE_DICT  # like torch's FSDP
    assert fs_default.state_dict_type is StateDictType.SHARDED_STATE_DICT  # like FSDP2
    assert result["previous"] == fsdp_default
    assert result["now"] == StateDictSettings(
        StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=True), ShardedOptimStateDictConfig()
    )
    assert result["inside"] is StateDictType.LOCAL_STATE_DICT and result["after"] == result["now"]


def _set_wrong_config(rank: int, world: int) -> None:
    FSDP.set_state_dict_type(shard(make(), "fsdp"), StateDictType.SHARDED_STATE_DICT, FullStateDictConfig())


def _mixed_settings(rank: int, world: int) -> None:
    model = shard(make(), "fsdp")
    FSDP.set_state_dict_type(model.blocks[0], StateDictType.LOCAL_STATE_DICT)
    FSDP.get_state_dict_type(model)


def _no_units(rank: int, world: int) -> None:
    FSDP.set_state_dict_type(make(), StateDictType.FULL_STATE_DICT)


def test_settings_errors(pool2: WorkerPool) -> None:
    with pytest.raises(RankFailure, match=re.escape("SHARDED_STATE_DICT takes a ShardedStateDictConfig")):
        pool2.run(_set_wrong_config)
    disagree = "get_state_dict_type(FullyShardedDataParallel): the units disagree: FullyShardedDataParallel(Buffered"
    with pytest.raises(RankFailure, match=re.escape(disagree)):
        pool2.run(_mixed_settings)
    with pytest.raises(RankFailure, match=re.escape("set_state_dict_type(module=BufferedGPT): the module holds no")):
        pool2.run(_no_units)


# --- mismatches -------------------------------------------------------------------------------------


def _load_bad(rank: int, world: int, entry: str, how: str, strict: bool) -> Any:
    model = shard(make(), entry)
    state = make(seed=2).state_dict()
    if how == "missing":
        del state["blocks.1.fc.bias"]
    elif how == "unexpected":
        state["blocks.1.extra"] = torch.zeros(2)
    else:
        state["blocks.0.fc.weight"] = torch.zeros(3, 3)
    result = model.load_state_dict(state, strict=strict)
    return list(result.missing_keys), list(result.unexpected_keys)


WHERE = {"fsdp": "FullyShardedDataParallel(BufferedGPT)", "fully_shard": "fully_shard(BufferedGPT)"}


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_load_mismatches_raise_naming_keys_and_shapes(pool2: WorkerPool, entry: str) -> None:
    start = f"{WHERE[entry]}.load_state_dict(strict=True): the state dict does not match the model: "
    with pytest.raises(RankFailure, match=re.escape(start + "missing keys ['blocks.1.fc.bias'] (1)")):
        pool2.run(_load_bad, entry, "missing", True)
    with pytest.raises(RankFailure, match=re.escape(start + "unexpected keys ['blocks.1.extra'] (1)")):
        pool2.run(_load_bad, entry, "unexpected", True)
    shape = "shape mismatches ['blocks.0.fc.weight': (3, 3) in the state dict, (61, 15) in the model]"
    with pytest.raises(RankFailure, match=re.escape(start + shape)):
        pool2.run(_load_bad, entry, "shape", True)
    with pytest.raises(RankFailure, match=re.escape(shape)):
        pool2.run(_load_bad, entry, "shape", False)  # shapes are checked even when not strict


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_non_strict_load_reports_clean_keys(pool2: WorkerPool, entry: str) -> None:
    assert pool2.run(_load_bad, entry, "missing", False)[0] == (["blocks.1.fc.bias"], [])
    assert pool2.run(_load_bad, entry, "unexpected", False)[1] == ([], ["blocks.1.extra"])


def _local_on_other_world(rank: int, world: int, saved: dict[str, Any]) -> None:
    model = shard(make(), "fsdp")
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        model.load_state_dict(saved)


def _local_saved(rank: int, world: int) -> dict[str, Any] | None:
    model = shard(make(), "fsdp")
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        state = model.state_dict()
    return {k: v.to_local().clone() if isinstance(v, DTensor) else v for k, v in state.items()} if rank == 0 else None


def test_local_state_dict_refuses_another_world_size(pool2: WorkerPool, pool4: WorkerPool) -> None:
    saved = pool2.run(_local_saved)[0]
    with pytest.raises(RankFailure, match=re.escape("Local state dicts only load into the same model on the same")):
        pool4.run(_local_on_other_world, saved)


def _plain_root(rank: int, world: int) -> bool:
    """A plain module holding sharded units: hooks give the same keys and values through it."""
    outer = nn.ModuleDict({"inner": shard(make(), "fsdp")})
    got = full_dict(outer)
    want = {f"inner.{k}": v for k, v in make().state_dict().items()}
    return same(got, want)


def test_state_dict_through_a_plain_parent_module(pool2: WorkerPool) -> None:
    assert pool2.run(_plain_root) == [True, True]

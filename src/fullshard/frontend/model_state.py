"""Model and optimizer state dicts of a sharded model, for saving and loading.

Two kinds of sharded model, two paths:

- ``fully_shard`` (``fsdp_version=2``): parameters are ``DTensor``s, so ``model.state_dict()`` already is
  the sharded state dict, and the optimizer's state tensors are ``DTensor``s too. The optimizer state dict
  is keyed by parameter name, as torch's ``get_optimizer_state_dict`` writes it. Loading is in place (the
  state dict's tensors share storage with the parameters and the optimizer state).
- ``FullyShardedDataParallel`` (``fsdp_version=1``): torch's API on the wrapper:
  ``FSDP.state_dict_type(model, type, config, optim_config)`` + ``model.state_dict()`` /
  ``load_state_dict``, ``FSDP.optim_state_dict`` and ``FSDP.optim_state_dict_to_load``.

The full model state dict (``get_state_dict``, ``save_model``) is gathered with ``summon_full_params`` for
both kinds: rank 0 gets every tensor on the CPU under its original name, the other ranks an empty dict.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.engine.api import FullStateDictConfig, StateDictType
from fullshard.engine.fully_shard import FSDPModule
from fullshard.engine.names import clean_key
from fullshard.engine.optim_init import init_optimizer_state as engine_init_optimizer_state
from fullshard.engine.state_dict import state_dict_type
from fullshard.engine.summon import summon_full_params
from fullshard.engine.wrapper import FullyShardedDataParallel
from fullshard.frontend.optim import AcceleratedOptimizer
from fullshard.frontend.plugin import FullyShardedDataParallelPlugin

__all__ = [
    "full_model_state_dict",
    "init_optimizer_state",
    "load_full_model_state_dict",
    "load_optim_state",
    "optim_state",
    "sharded_model_state_dict",
]


def _is_fsdp2(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextmanager
def _fsdp1_state_dict_type(
    model: nn.Module, plugin: FullyShardedDataParallelPlugin, kind: StateDictType | None = None
) -> Iterator[None]:
    """torch's ``FSDP.state_dict_type`` context on the wrapper (``fsdp_version=1``)."""
    if not hasattr(FullyShardedDataParallel, "state_dict_type"):
        raise NotImplementedError(
            "saving or loading a FullyShardedDataParallel (fsdp_version=1) model's sharded state needs "
            "FullyShardedDataParallel.state_dict_type, which this build of the engine lacks. Use "
            "FullyShardedDataParallelPlugin(fsdp_version=2), or update fullshard."
        )
    kind = kind or plugin.state_dict_type
    with FullyShardedDataParallel.state_dict_type(  # type: ignore[attr-defined]
        model, kind, plugin.state_dict_config, plugin.optim_state_dict_config
    ):
        yield


# --- model ------------------------------------------------------------------------------------------


def sharded_model_state_dict(model: nn.Module, plugin: FullyShardedDataParallelPlugin) -> dict[str, Any]:
    """This rank's shards of every parameter and buffer, by original name (DTensors for DCP)."""
    if _is_fsdp2(model):
        return model.state_dict()
    with _fsdp1_state_dict_type(model, plugin, StateDictType.SHARDED_STATE_DICT):
        return model.state_dict()


def finish_model_load(model: nn.Module, plugin: FullyShardedDataParallelPlugin, state: dict[str, Any]) -> None:
    """After ``state`` (from :func:`sharded_model_state_dict`) was filled in place, hand it to the model."""
    if _is_fsdp2(model):
        return  # the state dict's tensors are the parameters' own storage: already loaded
    with _fsdp1_state_dict_type(model, plugin, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(state)


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer in full, on the CPU, on rank 0 (other ranks: ``{}``); a collective."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        full = model.state_dict()
    if rank != 0:
        return {}
    return {clean_key(k): v.detach().cpu() for k, v in full.items()}


def load_full_model_state_dict(
    model: nn.Module, full_sd: dict[str, torch.Tensor] | None, *, strict: bool = True
) -> None:
    """Load a full state dict that rank 0 holds (others pass ``None``) into the sharded ``model``; a collective.

    Every rank gathers the full parameters (``summon_full_params``), receives each tensor from rank 0 and
    writes its rows back into its shards on exit. ``strict=False`` ignores keys the model lacks; every key the
    model has must be in ``full_sd`` with its shape either way.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    with summon_full_params(model, writeback=True), torch.no_grad():
        # The summoned parameters are full nn.Parameters under their original names (tied ones under each).
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        target = {clean_key(k): v for k, v in named}
        problem = [_full_problem(full_sd or {}, target, strict) if rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise ValueError(problem[0])
        for name, tensor in target.items():
            if rank == 0:
                tensor.copy_(full_sd[name])  # type: ignore[index]
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(tensor, src=0)


def _full_problem(full_sd: dict[str, torch.Tensor], target: dict[str, torch.Tensor], strict: bool) -> str | None:
    missing = sorted(set(target) - set(full_sd))
    unexpected = sorted(set(full_sd) - set(target)) if strict else []
    shapes = [f"{k}: {tuple(full_sd[k].shape)} vs {tuple(v.shape)}" for k, v in target.items()
              if k in full_sd and full_sd[k].shape != v.shape]  # fmt: skip
    if not (missing or unexpected or shapes):
        return None
    return (
        f"loading a full model state dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}, "
        f"shape mismatches (saved vs model) {shapes[:5]}. Load a checkpoint of the same model"
        + (", or pass strict=False to ignore keys the model lacks." if unexpected else ".")
    )


# --- optimizer --------------------------------------------------------------------------------------


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state a fresh optimizer lacks (zeros, parameters unchanged), as a template to load into.

    Steps the wrapped optimizer, never :class:`AcceleratedOptimizer` (whose ``step`` does nothing on an
    accumulation step). See [Note: loading into a fresh optimizer] in ``engine/optim_init.py``.
    """
    inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
    engine_init_optimizer_state(inner)


def _names(model: nn.Module) -> dict[int, str]:
    """Parameter id -> its first name (a tied parameter goes by the name it was registered under first).

    The same names as the engine's ``FSDP.optim_state_dict`` and torch's ``get_optimizer_state_dict``, so a
    checkpoint of either entry point, or of torch's FSDP, loads into the other.
    """
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), clean_key(name))
    return names


def _fsdp2_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    names = _names(model)
    missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if missing:
        raise ValueError(
            f"the optimizer holds {len(missing)} parameters that are not parameters of the model "
            f"{type(model).__name__}; save_state pairs the i-th prepared optimizer with the i-th prepared model. "
            "Pass models and optimizers to prepare() in matching order."
        )
    state = {names[id(p)]: dict(optimizer.state[p]) for g in optimizer.param_groups for p in g["params"]
             if p in optimizer.state}  # fmt: skip
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]  # fmt: skip
    return {"state": state, "param_groups": groups}


def optim_state(model: nn.Module, optimizer: torch.optim.Optimizer, plugin: FullyShardedDataParallelPlugin) -> Any:
    """The sharded optimizer state dict of ``optimizer`` over ``model``'s parameters, keyed by name."""
    if _is_fsdp2(model):
        return _fsdp2_optim_state(model, optimizer)
    with _fsdp1_state_dict_type(model, plugin, StateDictType.SHARDED_STATE_DICT):
        return FullyShardedDataParallel.optim_state_dict(model, optimizer)  # type: ignore[attr-defined]


def load_optim_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, plugin: FullyShardedDataParallelPlugin, loaded: Any
) -> None:
    """Hand ``loaded`` (a template from :func:`optim_state`, filled in place by DCP) to the optimizer."""
    if _is_fsdp2(model):
        for group, saved in zip(optimizer.param_groups, loaded["param_groups"]):
            for key, value in saved.items():
                if key != "params":
                    group[key] = type(group[key])(value) if isinstance(group.get(key), tuple) else value
        return  # the state tensors were filled in place
    with _fsdp1_state_dict_type(model, plugin, StateDictType.SHARDED_STATE_DICT):
        flat = FullyShardedDataParallel.optim_state_dict_to_load(model, optimizer, loaded)  # type: ignore[attr-defined]
    optimizer.load_state_dict(flat)


# --- full optimizer state (FULL_STATE_DICT) ---------------------------------------------------------


def full_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer, plugin: FullyShardedDataParallelPlugin) -> Any:
    """The optimizer state with every tensor in full, on the CPU, on rank 0 (``{}`` elsewhere); a collective."""
    if not _is_fsdp2(model):
        with _fsdp1_state_dict_type(model, plugin, StateDictType.FULL_STATE_DICT):
            return FullyShardedDataParallel.optim_state_dict(model, optimizer)  # type: ignore[attr-defined]
    from torch.distributed.tensor import DTensor

    osd = _fsdp2_optim_state(model, optimizer)

    def whole(value: Any) -> Any:
        if not torch.is_tensor(value):
            return value
        return (value.full_tensor() if isinstance(value, DTensor) else value).cpu()

    state = {name: {k: whole(v) for k, v in entry.items()} for name, entry in osd["state"].items()}
    return {"state": state, "param_groups": osd["param_groups"]} if dist.get_rank() == 0 else {}


def load_full_optim_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, plugin: FullyShardedDataParallelPlugin, full: Any
) -> None:
    """Load a full optimizer state dict that rank 0 holds (others pass ``None``); a collective."""
    if not _is_fsdp2(model):
        with _fsdp1_state_dict_type(model, plugin, StateDictType.FULL_STATE_DICT):
            flat = FullyShardedDataParallel.optim_state_dict_to_load(model, optimizer, full)  # type: ignore[attr-defined]
        optimizer.load_state_dict(flat)
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    init_optimizer_state(optimizer)
    template = _fsdp2_optim_state(model, optimizer)
    groups = [full["param_groups"] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(groups, src=0)
    with torch.no_grad():
        for name, entry in template["state"].items():
            for key, current in entry.items():
                source = full["state"][name][key] if dist.get_rank() == 0 else None
                if isinstance(current, DTensor):
                    whole = source.to(current.device, current.dtype) if source is not None else torch.empty(
                        current.shape, dtype=current.dtype, device=current.device)  # fmt: skip
                    piece = distribute_tensor(whole, current.device_mesh, current.placements, src_data_rank=0)
                    current.to_local().copy_(piece.to_local())
                elif torch.is_tensor(current):
                    if source is not None:
                        current.copy_(source)
                    dist.broadcast(current, src=0)
    load_optim_state(model, optimizer, plugin, {"param_groups": groups[0]})

"""Model and optimizer state dicts of a sharded model, for saving and loading, through the engine's API.

Both kinds of sharded model (``FullyShardedDataParallel``, ``fsdp_version=1``, and ``fully_shard``,
``fsdp_version=2``) carry the engine's state-dict hooks, so one path serves both: the engine's
``state_dict_type(model, type, config, optim_config)`` context with the plugin's configs, then
``model.state_dict()`` / ``load_state_dict``, ``optim_state_dict`` and ``optim_state_dict_to_load``. Keys are
the unwrapped model's names (parameter names for the optimizer, as torch's ``get_optimizer_state_dict``
writes them), so a checkpoint of either entry point, or of torch's FSDP, loads into the other.

A model prepared without sharding (one process, no FSDP: [Note: one process without FSDP] in
``frontend/one_process.py``) has no units and takes the same calls, answered from its plain tensors under the
same names, so its checkpoint folders are the sharded layout and load into a sharded model, and back.

Full state dicts are gathered to rank 0 (``full_model_state_dict``, ``full_optim_state``) and loaded from rank
0 through the one rank-0 → shards path (``algorithms/full_load.py`` and
``scatter_full_optim_state_dict``): the other ranks only ever receive their own rows.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.algorithms.full_load import load_full_state_dict
from fullshard.algorithms.optim_init import init_optimizer_state as engine_init_optimizer_state
from fullshard.engine import (
    FullStateDictConfig,
    FullyShardedDataParallel,
    StateDictType,
    has_units,
    optim_state_dict,
    optim_state_dict_to_load,
    scatter_full_optim_state_dict,
    state_dict_type,
)
from fullshard.frontend.optim import AcceleratedOptimizer
from fullshard.frontend.plugin import FullyShardedDataParallelPlugin

__all__ = [
    "full_model_state_dict",
    "has_units",
    "init_optimizer_state",
    "load_full_model_state_dict",
    "load_optim_state",
    "optim_state",
    "sharded_model_state_dict",
]


def _as(model: nn.Module, plugin: FullyShardedDataParallelPlugin, kind: StateDictType) -> AbstractContextManager[None]:
    """The engine's ``state_dict_type`` context for ``kind``, with the plugin's configs when they are of that kind."""
    if not has_units(model):  # a model prepared as it is: its plain state dict
        return nullcontext()
    configs = (plugin.state_dict_config, plugin.optim_state_dict_config) if plugin.state_dict_type is kind else ()
    return state_dict_type(model, kind, *configs)


# --- model ------------------------------------------------------------------------------------------


def sharded_model_state_dict(model: nn.Module, plugin: FullyShardedDataParallelPlugin) -> dict[str, Any]:
    """This rank's shards of every parameter and buffer, by original name (DTensors for DCP)."""
    with _as(model, plugin, StateDictType.SHARDED_STATE_DICT):
        return model.state_dict()


def finish_model_load(model: nn.Module, plugin: FullyShardedDataParallelPlugin, state: dict[str, Any]) -> None:
    """After ``state`` (from :func:`sharded_model_state_dict`) was filled in place, hand it to the model."""
    with _as(model, plugin, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(state)


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer in full, on the CPU, on rank 0 (other ranks: ``{}``); a collective."""
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with state_dict_type(model, StateDictType.FULL_STATE_DICT, config) if has_units(model) else nullcontext():
        full = model.state_dict()
    return {k: v.detach().cpu() for k, v in full.items()} if dist.get_rank() == 0 else {}


def load_full_model_state_dict(
    model: nn.Module, full_sd: dict[str, torch.Tensor] | None, *, strict: bool = True
) -> None:
    """Load a full state dict that rank 0 holds (others pass ``None``) into the sharded ``model``; a collective.

    ``strict=False`` ignores keys the model lacks; every key the model has must be in ``full_sd`` with its shape.
    """
    if not has_units(model):  # a model prepared as it is (one process): rank 0 holds every tensor
        model.load_state_dict(full_sd or {}, strict=strict)
        return
    load_full_state_dict(model, full_sd, strict=strict, caller="loading a full model state dict")


# --- optimizer --------------------------------------------------------------------------------------


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state a fresh optimizer lacks (zeros, parameters unchanged), as a template to load into.

    Steps the wrapped optimizer, never :class:`AcceleratedOptimizer` (whose ``step`` does nothing on an
    accumulation step). See [Note: loading into a fresh optimizer] in ``algorithms/optim_init.py``.
    """
    inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
    engine_init_optimizer_state(inner)


def optim_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, plugin: FullyShardedDataParallelPlugin, *, full: bool = False
) -> Any:
    """The optimizer state dict of ``optimizer`` over ``model``'s parameters, keyed by name: sharded (DTensors),
    or with ``full`` every tensor in full, on the CPU, on rank 0 (``{}`` elsewhere; a collective)."""
    kind = StateDictType.FULL_STATE_DICT if full else StateDictType.SHARDED_STATE_DICT
    if not has_units(model):  # a model prepared as it is: the same names, plain tensors
        if full:
            return FullyShardedDataParallel.full_optim_state_dict(model, optimizer, rank0_only=True)
        return FullyShardedDataParallel.sharded_optim_state_dict(model, optimizer)
    with _as(model, plugin, kind):
        return optim_state_dict(model, optimizer)


def load_optim_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, plugin: FullyShardedDataParallelPlugin, loaded: Any
) -> None:
    """Hand ``loaded`` (a template from :func:`optim_state`, filled in place by DCP) to the optimizer. Its tensors
    are the optimizer's own (or fresh ones DCP allocated): handed over, never copied, so that loading costs no
    second copy of the optimizer state."""
    if not has_units(model):  # a model prepared as it is
        optimizer.load_state_dict(FullyShardedDataParallel.flatten_sharded_optim_state_dict(loaded, model, optimizer))
        return
    with _as(model, plugin, StateDictType.SHARDED_STATE_DICT):
        flat = optim_state_dict_to_load(model, optimizer, loaded, copy=False)
    optimizer.load_state_dict(flat)


# --- full optimizer state (FULL_STATE_DICT) ---------------------------------------------------------


def load_full_optim_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, plugin: FullyShardedDataParallelPlugin, full: Any
) -> None:
    """Load a full optimizer state dict that rank 0 holds (others pass ``None``); a collective."""
    del plugin  # only rank 0 read the file, whatever rank0_only the plugin saved with
    if not has_units(model):  # a model prepared as it is (one process): rank 0 holds the whole state
        optimizer.load_state_dict(FullyShardedDataParallel.shard_full_optim_state_dict(full, model, optim=optimizer))
        return
    optimizer.load_state_dict(scatter_full_optim_state_dict(full, model, optim=optimizer))

"""Accelerate's per-object FSDP checkpoint functions: ``save_fsdp_model``, ``load_fsdp_model``,
``save_fsdp_optimizer``, ``load_fsdp_optimizer`` (what transformers' ``Trainer`` saves and resumes with).

Accelerate's layout inside ``output_dir``, chosen by ``fsdp_plugin.state_dict_type``:

- ``SHARDED_STATE_DICT``: ``pytorch_model_fsdp_<i>/`` (``{"model": ...}``) and ``optimizer_<i>/``
  (``{"optimizer": ...}``), each written by :func:`fullshard.checkpoint.save_sharded`: staged, checksummed
  and renamed into place with its completion marker, so an interrupted save leaves no half folder to resume from;
- ``FULL_STATE_DICT``: ``pytorch_model_fsdp.bin`` / ``optimizer.bin`` (``_<i>`` after the first), gathered to
  and written by rank 0 (``checkpoint.save_file``: under a temporary name unique to the write, then renamed).

Every function is a collective: call it on every rank. ``adapter_only`` (which transformers always passes) is
honoured as Accelerate does: for a PEFT model the model files hold the entries PEFT saves for the active adapter
(under the model's own keys, in the same layout), and loading puts them back leaving the frozen base as it is;
any other model is saved whole.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.checkpoint import (
    FSDP_MODEL_NAME,
    OPTIMIZER_NAME,
    full_model_file_name,
    load_sharded,
    load_small_file,
    model_folder_name,
    optimizer_file_name,
    optimizer_folder_name,
    save_file,
    save_sharded,
)
from fullshard.engine import StateDictType
from fullshard.frontend.adapters import is_peft_model
from fullshard.frontend.plugin import FullyShardedDataParallelPlugin
from fullshard.frontend.saving import model_state
from fullshard.frontend.training import extract_model_from_parallel

__all__ = ["load_fsdp_model", "load_fsdp_optimizer", "save_fsdp_model", "save_fsdp_optimizer"]


def _kind(plugin: FullyShardedDataParallelPlugin, where: str) -> StateDictType:
    kind = plugin.state_dict_type
    if kind not in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
        raise ValueError(
            f"{where}: fsdp_plugin.state_dict_type={kind.name} is not written by these functions; use "
            "FULL_STATE_DICT or SHARDED_STATE_DICT (or Accelerator.save_state for every type)."
        )
    return kind


def _adapter_keys(model: nn.Module, adapter_only: bool, plugin: FullyShardedDataParallelPlugin) -> set[str] | None:
    """With ``adapter_only`` and a PEFT model: the state-dict keys of its active adapter; else ``None`` (whole)."""
    if not (adapter_only and is_peft_model(model)):
        return None
    from peft import get_peft_model_state_dict

    state = model_state.sharded_model_state_dict(model, plugin)
    peft_model = extract_model_from_parallel(model)
    chosen = get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=peft_model.active_adapter)
    ids = {id(value) for value in chosen.values()}
    return {key for key, value in state.items() if id(value) in ids}


def _only(state: dict[str, Any], keys: set[str] | None) -> dict[str, Any]:
    return state if keys is None else {k: v for k, v in state.items() if k in keys}


def _save_on_rank0(obj: Any, path: Path) -> None:
    if dist.get_rank() == 0:
        save_file(obj, path)  # a temporary unique to this write, renamed over path when whole
    dist.barrier()


def _folder(input_dir: str | os.PathLike[str], prefix: str, index: int) -> Path:
    """Accelerate's rule: ``input_dir`` is the folder itself when its name carries the prefix."""
    path = Path(input_dir)
    return path if prefix in path.name else path / f"{prefix}_{index}"


def save_fsdp_model(
    fsdp_plugin: FullyShardedDataParallelPlugin,
    accelerator: Any,
    model: nn.Module,
    output_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
) -> None:
    """Write ``model`` into ``output_dir`` as the plugin's ``state_dict_type`` says (see the module docstring)."""
    del accelerator
    kind = _kind(fsdp_plugin, "save_fsdp_model")
    keys = _adapter_keys(model, adapter_only, fsdp_plugin)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if kind is StateDictType.FULL_STATE_DICT:
        _save_on_rank0(_only(model_state.full_model_state_dict(model), keys), out / full_model_file_name(model_index))
    else:
        state = {"model": _only(model_state.sharded_model_state_dict(model, fsdp_plugin), keys)}
        save_sharded(state, out / model_folder_name(model_index))


def load_fsdp_model(
    fsdp_plugin: FullyShardedDataParallelPlugin,
    accelerator: Any,
    model: nn.Module,
    input_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
) -> None:
    """Load what :func:`save_fsdp_model` wrote into the sharded ``model`` (checked before anything changes).

    An adapter-only file is laid over the model's current entries, so the frozen base keeps its weights.
    """
    del accelerator
    kind = _kind(fsdp_plugin, "load_fsdp_model")
    keys = _adapter_keys(model, adapter_only, fsdp_plugin)
    if kind is StateDictType.FULL_STATE_DICT:
        path = Path(input_dir)
        path = path if path.is_file() else path / full_model_file_name(model_index)
        sd = load_small_file(path) if dist.get_rank() == 0 else None
        if keys is not None:  # the current weights, with the adapter's entries from the file
            current = model_state.full_model_state_dict(model)
            sd = {**current, **_only(sd, keys)} if sd is not None else None
        model_state.load_full_model_state_dict(model, sd)
        return
    state = model_state.sharded_model_state_dict(model, fsdp_plugin)
    load_sharded({"model": _only(state, keys)}, _folder(input_dir, FSDP_MODEL_NAME, model_index))
    model_state.finish_model_load(model, fsdp_plugin, state)


def save_fsdp_optimizer(
    fsdp_plugin: FullyShardedDataParallelPlugin,
    accelerator: Any,
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    output_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
) -> None:
    """Write ``optimizer``'s state (keyed by ``model``'s parameter names) into ``output_dir``."""
    del accelerator
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if _kind(fsdp_plugin, "save_fsdp_optimizer") is StateDictType.FULL_STATE_DICT:
        osd = model_state.optim_state(model, optimizer, fsdp_plugin, full=True)
        _save_on_rank0(osd, out / optimizer_file_name(optimizer_index))
        return
    model_state.init_optimizer_state(optimizer)  # every parameter's state, zeros before the first step
    state = {"optimizer": model_state.optim_state(model, optimizer, fsdp_plugin)}
    save_sharded(state, out / optimizer_folder_name(optimizer_index))


def load_fsdp_optimizer(
    fsdp_plugin: FullyShardedDataParallelPlugin,
    accelerator: Any,
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    input_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
    adapter_only: bool = False,
) -> None:
    """Load what :func:`save_fsdp_optimizer` wrote into ``optimizer``."""
    del accelerator, adapter_only  # the optimizer holds the trainable parameters only, adapters or not
    if _kind(fsdp_plugin, "load_fsdp_optimizer") is StateDictType.FULL_STATE_DICT:
        path = Path(input_dir)
        path = path if path.is_file() else path / optimizer_file_name(optimizer_index)
        osd = load_small_file(path) if dist.get_rank() == 0 else None
        model_state.load_full_optim_state(model, optimizer, fsdp_plugin, osd)
        return
    model_state.init_optimizer_state(optimizer)
    state = {"optimizer": model_state.optim_state(model, optimizer, fsdp_plugin)}
    load_sharded(state, _folder(input_dir, OPTIMIZER_NAME, optimizer_index))
    model_state.load_optim_state(model, optimizer, fsdp_plugin, state["optimizer"])

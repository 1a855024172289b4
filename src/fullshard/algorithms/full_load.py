"""Loading a full model state dict that only rank 0 holds into a sharded model: rank 0 → every rank's shards.

Rank 0 checks its dict against the model (keys and full shapes, as ``load_state_dict`` does) and broadcasts
its verdict, so a dict that does not fit raises the same ``ValueError`` on every rank before any tensor
moves. Then the parameters of each unit travel as the optimizer state does in
``optim_state.scatter_full_optim_state_dict`` (the same code, ``optim_state.scatter_states``): one flat
buffer per unit, laid out like the unit's flat shard, scattered from rank 0, so every other rank receives
only its own rows and never holds a full unit. The tensors no unit shards (buffers, parameters outside units)
are broadcast whole and loaded by ``load_state_dict``, as are frozen quantized parameters (4-bit QLoRA weights,
``engine/extension.py``), one at a time, each rank keeping its rows. A tied parameter is loaded once, from its first
name.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from fullshard.engine import (
    StateSpec,
    clean_key,
    expected_entries,
    extension_params,
    mismatches,
    model_params,
    scatter_states,
)

__all__ = ["load_full_state_dict"]

_VALUE = "value"  # the one "state" of a parameter in scatter_states' terms


def load_full_state_dict(
    model: nn.Module,
    full_state_dict: Mapping[str, torch.Tensor] | None,
    *,
    strict: bool = True,
    caller: str = "load_full_state_dict",
) -> None:
    """Load ``full_state_dict`` (full tensors under the unwrapped model's keys), which only rank 0 needs to hold
    (other ranks pass ``None`` or ``{}``), into the sharded ``model``; a collective over the default group.

    Every key the model has must be in the dict, with its full shape; ``strict`` also refuses keys the model
    lacks. ``caller`` starts the error message.
    """
    rank = dist.get_rank()
    if rank == 0 and isinstance(full_state_dict, Mapping):
        full_state_dict = {clean_key(k): v for k, v in full_state_dict.items()}
    problem = [_problem(model, full_state_dict, strict, caller) if rank == 0 else None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ValueError(problem[0])
    params = [p for p in model_params(model) if p.unit is not None and p.sp is not None]
    specs = {p.fqn: {_VALUE: StateSpec(p.sp.shape, p.sp.dtype)} for p in params}  # type: ignore[union-attr]
    full = {p.fqn: {_VALUE: full_state_dict[p.fqn]} for p in params} if rank == 0 else None  # type: ignore[index]
    rows = scatter_states(params, {"state": specs}, full, dist.group.WORLD, 0)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in params:
            p.unit.reshard()  # type: ignore[union-attr]
            p.sp.local_view(p.unit.flat_shard).copy_(rows[p.fqn][_VALUE])  # type: ignore[union-attr]
        whole = {}
        for key, tensor in expected_entries(model).whole.items():
            value = torch.empty_like(tensor) if rank != 0 else full_state_dict[key].to(tensor.device, tensor.dtype)  # type: ignore[index]
            dist.broadcast(value, src=0)
            whole[key] = value
        for key, extension, param in extension_params(model):
            quantized = [full_state_dict[key] if rank == 0 else None]  # type: ignore[index]
            dist.broadcast_object_list(quantized, src=0)
            extension.load(param, quantized[0], key)
    model.load_state_dict(whole, strict=False)


def _problem(model: nn.Module, full: object, strict: bool, caller: str) -> str | None:
    """Rank 0's verdict on its dict: the error message, or ``None`` when it fits ``model``."""
    if not isinstance(full, Mapping):
        return f"{caller}: rank 0 must pass the full state dict (a dict of name -> tensor), got {type(full).__name__}."
    missing, unexpected, shapes = mismatches(model, full)
    unexpected = unexpected if strict else []
    if not (missing or unexpected or shapes):
        return None
    return (
        f"{caller}: rank 0's full state dict does not fit the model: missing keys {missing[:5]}, unexpected keys "
        f"{unexpected[:5]}, shape mismatches {shapes[:5]}. Load a state dict of the same model"
        + (", or pass strict=False to ignore keys the model lacks." if unexpected else ".")
    )

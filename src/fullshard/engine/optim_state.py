"""Optimizer state dicts of sharded models, keyed by parameter names (the unwrapped model's FQNs).

This module builds each form below and the loadable dict, scatters a full dict held by rank 0 and re-keys dicts;
the optimizer's parameters by name (``Param``, ``model_params``) and its state dict re-keyed from ids to names
come from ``optim_params.py``.

[Note: optimizer state of a sharded parameter]
The optimizer steps on each unit's sharded parameters (``ShardedParam.sharded_param``), so the
per-element states it keeps (Adam's ``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``) have the
parameter's local shape ``layout.local_shape`` (DTensors under ``fully_shard``). Every state tensor of
positive dimension of a sharded parameter is taken to be such a per-element state, as torch's FSDP does;
0-dim tensors (``step``) and non-tensors are equal on every rank and pass through. The forms:

- full: ``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}`` with per-element
  states as full tensors, gathered one unit and one state name at a time (one all-gather of a flat buffer
  laid out like the unit's flat shard).
- sharded: the same keys; per-element states as DTensors of the parameter's full shape on the unit's mesh,
  placed as in the model's sharded state dict (see ``state_dict.py``). No communication.
- local: the same keys; per-element states as this rank's plain local tensors. No communication.
- loadable (what ``optim.load_state_dict`` takes): integer ids in the optimizer's order, per-element states
  as this rank's rows (fresh tensors), DTensors where the optimizer's parameter is one.

Parameters outside any unit (ignored ones) are whole on every rank and pass through in every form.

A matrix optimizer stepped through ``algorithms/whole_step.py`` also keeps states that are whole on every rank
(Adafactor's row and column statistics, a preconditioner): each param group lists them per parameter under
``WHOLE_STATES_KEY``, in ``params`` order, and they pass through every form like ``step`` (saved with the
group, so a loaded dict says which of its states are whole).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.engine import state_dict as sd
from fullshard.engine.api import OptimStateKeyType, StateDictType
from fullshard.engine.coerce import coerce_enum
from fullshard.engine.group import ParamGroup
from fullshard.engine.optim_params import (
    WHOLE_STATES_KEY,
    OsdT,
    Param,
    check_names,
    is_elementwise,
    model_params,
    named_state,
    target_rows,
    whole_names,
    whole_value,
)
from fullshard.engine.param import local_tensor
from fullshard.engine.state_dict import get_state_dict_type, sharded_dtensor
from fullshard.ranks import gather_from_ranks, global_rank

__all__ = [
    "WHOLE_STATES_KEY",
    "flatten_sharded_optim_state_dict",
    "full_optim_state_dict",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "StateSpec",
    "rekey_optim_state_dict",
    "scatter_full_optim_state_dict",
    "scatter_states",
    "shard_full_optim_state_dict",
    "sharded_optim_state_dict",
]


# --- full -----------------------------------------------------------------------------------------------


def _gather_unit_state(unit: ParamGroup, holders: list[Param], values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Full tensors of one per-element state of ``holders`` (params of ``unit``): one all-gather."""
    dtype = local_tensor(values[0]).dtype
    flat = torch.zeros(unit.shard_numel, dtype=dtype, device=unit.device)
    for p, value in zip(holders, values):
        local = local_tensor(value)
        if p.sp is None or tuple(local.shape) != p.sp.local_shape:
            raise ValueError(
                f"[rank {global_rank()}] full_optim_state_dict: optimizer state of {p.fqn!r} has shape "
                f"{tuple(local.shape)}, but this rank's shard of the parameter has shape "
                f"{None if p.sp is None else p.sp.local_shape}. Pass the state dict of this optimizer "
                "(optim.state_dict(), or None), built after wrapping and stepped on the sharded parameters."
            )
        p.sp.local_view(flat).copy_(local)
    fulls = unit.gather_full(flat)
    index = {id(sp): i for i, sp in enumerate(unit.params)}
    # A tensor parallel parameter's gathered state is its tp part: the full one takes a collective over tp.
    return [p.sp.full_of_gathered(fulls[index[id(p.sp)]]).to(local_tensor(v).dtype) for p, v in zip(holders, values)]


def _by_unit(params: list[Param], states: dict[str, dict[str, Any]]) -> list[tuple[ParamGroup, list[Param]]]:
    """Parameters with state, by unit, in optimizer order (the same on every rank)."""
    units: dict[int, tuple[ParamGroup, list[Param]]] = {}
    for p in params:
        if p.unit is not None and p.fqn in states:
            units.setdefault(id(p.unit), (p.unit, []))[1].append(p)
    return list(units.values())


def _elementwise_names(
    members: list[Param], states: dict[str, dict[str, Any]], whole: dict[str, set[str]] | None = None
) -> list[str]:
    names: dict[str, None] = {}
    for p in members:
        skip = (whole or {}).get(p.fqn, set())
        names.update(
            (n, None)
            for n, v in states[p.fqn].items()
            if (is_elementwise(v) and n not in skip) or isinstance(v, StateSpec)
        )
    return list(names)


def _full_states(
    params: list[Param], states: dict[str, dict[str, Any]], keep: bool, offload: bool, whole: dict[str, set[str]]
) -> dict[str, dict[str, Any]]:
    """``states`` with per-element states of sharded parameters gathered in full (collective on every rank)."""
    out = {fqn: dict(state) for fqn, state in states.items()} if keep else {}
    for unit, members in _by_unit(params, states):
        for name in _elementwise_names(members, states, whole):
            holders = [
                p for p in members if is_elementwise(states[p.fqn].get(name)) and name not in whole.get(p.fqn, set())
            ]
            fulls = _gather_unit_state(unit, holders, [states[p.fqn][name] for p in holders])
            for p, full in zip(holders, fulls):
                if keep:
                    out[p.fqn][name] = full
    if keep and offload:
        out = {fqn: {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in s.items()} for fqn, s in out.items()}
    return out


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: Any = None,
    rank0_only: bool = True,
    group: dist.ProcessGroup | None = None,
    *,
    optim_state_dict: OsdT | None = None,
    offload_to_cpu: bool = True,
) -> OsdT:
    """The full optimizer state dict keyed by FQNs (see the module note); ``{}`` on ranks > 0 if ``rank0_only``.

    ``optim_input`` (deprecated by torch) is refused: the parameters and their order are read from ``optim``."""
    if optim_input is not None:
        raise ValueError(
            "FullyShardedDataParallel.full_optim_state_dict(optim_input=...) is not supported (torch deprecated "
            "it): the parameters and their order are read from `optim`. Drop optim_input."
        )
    rows, states, groups = named_state(model, optim, optim_state_dict, "full_optim_state_dict")
    keep = not rank0_only or dist.get_rank(group) == 0
    full = _full_states([p for row in rows for p in row], states, keep, offload_to_cpu, whole_names(groups))
    return {"state": full, "param_groups": groups} if keep else {}


# --- sharded and local --------------------------------------------------------------------------------


def sharded_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    group: dist.ProcessGroup | None = None,
    *,
    optim_state_dict: OsdT | None = None,
    offload_to_cpu: bool = False,
    as_dtensor: bool = True,
) -> OsdT:
    """Keyed by FQNs, per-element states as DTensors of the full shape, or with ``as_dtensor=False`` as this
    rank's plain local tensors (the local form). No communication, so ``group`` must span the world (or be
    None): the DTensors lie on the units' own meshes."""
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(
            f"sharded_optim_state_dict(group=<process group of ranks {dist.get_process_group_ranks(group)}>): the "
            "sharded form uses the process groups the model was wrapped with and takes no other group. Pass None."
        )
    rows, states, groups = named_state(model, optim, optim_state_dict, "sharded_optim_state_dict")
    params = {p.fqn: p for row in rows for p in row}
    whole = whole_names(groups)

    def convert(p: Param, name: str, value: Any) -> Any:
        if p.unit is None or p.sp is None or not is_elementwise(value) or name in whole.get(p.fqn, set()):
            return value
        local = local_tensor(value).detach()
        local = local.cpu() if offload_to_cpu else local
        return sharded_dtensor(p.unit, p.sp, local) if as_dtensor else local

    state = {fqn: {n: convert(params[fqn], n, v) for n, v in s.items()} for fqn, s in states.items()}
    return {"state": state, "param_groups": groups}


# --- loadable -----------------------------------------------------------------------------------------


def _like_param(p: Param, rows: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """``rows`` (this rank's) on the parameter's device (a fresh tensor if ``copy``), a DTensor where the
    parameter is one."""
    rows = rows.to(local_tensor(p.param).device, copy=copy)
    if isinstance(p.param, DTensor) and p.unit is not None and p.sp is not None:
        return sharded_dtensor(p.unit, p.sp, rows)
    return rows


def _to_local_state(p: Param, name: str, value: Any, copy: bool = True) -> Any:
    """One saved state value (full, DTensor, or this rank's local rows) as the optimizer must hold it; without
    ``copy``, this rank's rows are handed over as they are where they already are a tensor of their own."""
    if not isinstance(value, torch.Tensor):
        return value
    if p.unit is None or p.sp is None or not is_elementwise(value):
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        return whole.clone()
    shape = tuple(value.shape)
    if not isinstance(value, DTensor) and shape == p.sp.local_shape and shape != p.sp.shape:
        rows = value  # already this rank's rows (a local optimizer state dict)
    else:
        rows = sd.rows_of(p.unit, p.sp, value, f"optimizer state {name!r} of {p.fqn!r}")
    return _like_param(p, rows, copy)


def _loadable(
    osd: OsdT,
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    optim_input: Iterable[Any] | None,
    caller: str,
    convert: Callable[[Param, str, Any], Any] = _to_local_state,
    named: bool = False,
) -> OsdT:
    """Build what ``optim.load_state_dict`` takes from an FQN-keyed ``osd``; see the module note.

    The optimizer's parameter groups come from ``optim``, else ``optim_input``; without either, from the groups
    of ``osd`` in their order. ``convert(param, name, value)`` makes each saved value this rank's.
    """
    rows = target_rows(model, optim, optim_input, caller)
    params = {p.fqn: p for p in model_params(model)}
    states, saved_groups = osd["state"], osd["param_groups"]
    check_names(states, params, caller)
    if rows is None:
        check_names({f: None for g in saved_groups for f in g["params"]}, params, caller)
        rows = [[params[f] for f in g["params"]] for g in saved_groups]
    group_of = {fqn: g for g in saved_groups for fqn in g["params"]}
    whole = whole_names(saved_groups)
    # A group with no parameters (transformers' Trainer leaves its weight-decay group empty when no parameter
    # takes weight decay) takes the saved empty groups in their order.
    empty_saved = [g for g in saved_groups if not g["params"]]
    out_state: dict[Any, Any] = {}
    out_groups = []
    next_id = 0
    for row in rows:
        if row:
            source = next((group_of[p.fqn] for p in row if p.fqn in group_of), None)
        else:
            source = empty_saved.pop(0) if empty_saved else None
        if source is None:
            raise ValueError(
                f"{caller}: the optimizer's param group holding {[p.fqn for p in row][:4]} matches no param group "
                "of the optimizer state dict. Build the optimizer with the same parameter groups as when it was saved."
            )
        ids = []
        for p in row:
            key = p.fqn if named else next_id
            if p.fqn in states:
                skip = whole.get(p.fqn, set())
                out_state[key] = {
                    n: whole_value(p, v) if n in skip and isinstance(v, torch.Tensor) else convert(p, n, v)
                    for n, v in states[p.fqn].items()
                }
            ids.append(key)
            next_id += 1
        out_groups.append({**{k: v for k, v in source.items() if k != "params"}, "params": ids})
    return {"state": out_state, "param_groups": out_groups}


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: OsdT,
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    copy: bool = True,
) -> OsdT:
    """What ``optim.load_state_dict`` takes, from a full, sharded or local FQN-keyed dict.

    Under FULL_STATE_DICT with ``rank0_only`` only rank 0 needs to hold the dict: it is scattered.
    ``copy=False``: the caller gives ``optim_state_dict`` up, and this rank's rows in it become the optimizer's
    state without a copy (a checkpoint loaded in place into :func:`optim_state_dict`'s own tensors then costs
    no memory; with copies it would hold the Adam state twice).
    """
    settings = get_state_dict_type(model)
    rank0_only = getattr(settings.optim_state_dict_config, "rank0_only", False)
    if settings.state_dict_type is StateDictType.FULL_STATE_DICT and rank0_only:
        result = scatter_full_optim_state_dict(optim_state_dict, model, optim=optim, group=group)
    else:
        convert = functools.partial(_to_local_state, copy=copy)
        caller = "optim_state_dict_to_load"
        result = _loadable(optim_state_dict, model, optim, None, caller, convert, named=is_named_optimizer)
    if load_directly:
        optim.load_state_dict(result)
    return result


def shard_full_optim_state_dict(
    full_optim_state_dict: OsdT,
    model: nn.Module,
    optim_input: Iterable[Any] | None = None,
    optim: torch.optim.Optimizer | None = None,
) -> OsdT:
    """This rank's part of a full FQN-keyed dict, loadable by ``optim`` (no communication).

    Without ``optim`` (or ``optim_input``) the optimizer is assumed to have the dict's param groups, in order.
    """
    return _loadable(full_optim_state_dict, model, optim, optim_input, "shard_full_optim_state_dict")


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: OsdT, model: nn.Module, optim: torch.optim.Optimizer
) -> OsdT:
    """This rank's part of a sharded FQN-keyed dict (DTensors), loadable by ``optim``."""
    return _loadable(sharded_optim_state_dict, model, optim, None, "flatten_sharded_optim_state_dict")


def optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: OsdT | None = None, group: Any = None
) -> OsdT:
    """The optimizer state dict in the form set by the model's state dict type (full, sharded or local)."""
    settings = get_state_dict_type(model)
    config, kind = settings.optim_state_dict_config, settings.state_dict_type
    common = {"optim_state_dict": optim_state_dict, "offload_to_cpu": config.offload_to_cpu, "group": group}
    if kind is StateDictType.FULL_STATE_DICT:
        return full_optim_state_dict(model, optim, rank0_only=getattr(config, "rank0_only", False), **common)
    return sharded_optim_state_dict(model, optim, as_dtensor=kind is StateDictType.SHARDED_STATE_DICT, **common)


# --- scatter ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateSpec:
    """Stands for a tensor in the structure rank 0 broadcasts before scattering."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _skeleton_or_error(full: Any) -> OsdT | str:
    """``full`` with per-element states replaced by :class:`StateSpec`, or the error every rank raises."""
    if isinstance(full, dict) and isinstance(full.get("state"), dict) and "param_groups" in full:
        whole = whole_names(full["param_groups"])
        state = {
            fqn: {
                n: StateSpec(tuple(v.shape), v.dtype) if is_elementwise(v) and n not in whole.get(fqn, set()) else v
                for n, v in s.items()
            }
            for fqn, s in full["state"].items()
        }
        return {"state": state, "param_groups": full["param_groups"]}
    return (
        f"scatter_full_optim_state_dict(full_optim_state_dict={type(full).__name__}): rank 0 must pass the full "
        "optimizer state dict (from full_optim_state_dict(), with 'state' and 'param_groups'); other ranks may "
        "pass None."
    )


def _check_spec_shapes(skeleton: OsdT, params: dict[str, Param]) -> None:
    for fqn, state in skeleton["state"].items():
        p = params[fqn]
        want = p.sp.shape if p.sp is not None else tuple(p.param.shape)
        for name, value in state.items():
            if isinstance(value, StateSpec) and value.shape != want:
                raise ValueError(
                    f"scatter_full_optim_state_dict: optimizer state {name!r} of {fqn!r} has shape {value.shape} "
                    f"but the parameter has shape {want}. Load a state dict saved from this architecture."
                )


def _scatter_unit(
    unit: ParamGroup,
    holders: list[Param],
    name: str,
    full_states: dict[str, dict[str, Any]] | None,
    shard_ranks: list[int],
    pg: dist.ProcessGroup,
    src: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Scatter one per-element state of ``holders`` from ``src``; returns this rank's flat shard of it."""
    out = torch.empty(unit.shard_numel, dtype=dtype, device=unit.device)
    pieces = None
    if full_states is not None:
        pieces = []
        for shard_rank in shard_ranks:
            flat = torch.zeros(unit.shard_numel, dtype=dtype, device=unit.device)
            for p in holders:
                if p.sp is None:
                    raise AssertionError(f"[rank {global_rank()}] {p.fqn}: scattered without a unit")
                rows = p.sp.rows_of(full_states[p.fqn][name], shard_rank)
                # a flat shard holds rows in the layout's dim order (``move``: Shard(d) puts dim d first), as
                # ``local_view`` reads them back; flattening in the parameter's order scattered Shard(1) states wrong
                flat.narrow(0, p.sp.offset, rows.numel()).copy_(p.sp.move(rows).reshape(-1))
            pieces.append(flat)
    dist.scatter(out, pieces, src=src, group=pg)
    return out


def scatter_states(
    params: list[Param], skeleton: OsdT, full_states: dict[str, dict[str, Any]] | None, pg: dist.ProcessGroup, src: int
) -> dict[str, dict[str, Any]]:
    """Every rank's local per-element states, scattered unit by unit from ``src`` (the one rank-0 → shards path)."""
    tensor_parallel = [p.fqn for p in params if p.sp is not None and p.sp.tp is not None]
    if tensor_parallel:  # every rank has the same model, so every rank raises here, before any collective
        raise ValueError(
            f"loading a full state dict held by rank 0 only: parameters {tensor_parallel[:3]} are tensor parallel, "
            "and scattering from rank 0 splits over data-parallel ranks only. Give every rank the full state dict "
            "and call model.load_state_dict(full) (each rank takes its own part), or save and load the sharded "
            "state dict with torch.distributed.checkpoint."
        )
    specs = skeleton["state"]
    out = {fqn: dict(s) for fqn, s in specs.items()}
    units = list({id(p.unit): p.unit for p in params if p.unit is not None}.values())
    position = {id(u): i for i, u in enumerate(units)}
    everyone = gather_from_ranks([u.shard_group.shard_rank for u in units], pg)
    for unit, members in _by_unit(params, specs):
        column = [ranks[position[id(unit)]] for ranks in everyone]
        for name in _elementwise_names(members, specs):
            holders = [p for p in members if isinstance(specs[p.fqn].get(name), StateSpec)]
            if not holders:  # whole on every rank (see the module note): rank 0 sent it with the structure
                continue
            dtype = specs[holders[0].fqn][name].dtype
            flat = _scatter_unit(unit, holders, name, full_states, column, pg, src, dtype)
            for p in holders:
                out[p.fqn][name] = p.sp.local_view(flat).to(specs[p.fqn][name].dtype, copy=True)  # type: ignore[union-attr]
    for p in params:
        for name, value in out.get(p.fqn, {}).items():
            if isinstance(value, StateSpec):  # a parameter outside any unit: whole on every rank
                tensor = (
                    full_states[p.fqn][name] if full_states is not None else torch.empty(value.shape, dtype=value.dtype)
                )
                tensor = tensor.to(local_tensor(p.param).device)
                dist.broadcast(tensor, src=src, group=pg)
                out[p.fqn][name] = tensor
    return out


def scatter_full_optim_state_dict(
    full_optim_state_dict: OsdT | None,
    model: nn.Module,
    optim_input: Iterable[Any] | None = None,
    optim: torch.optim.Optimizer | None = None,
    group: dist.ProcessGroup | None = None,
) -> OsdT:
    """Like :func:`shard_full_optim_state_dict`, but only rank 0 (of ``group``) holds the full dict.

    Rank 0 broadcasts the dict's structure (no tensors), then scatters each unit's per-element states one
    state name at a time: every other rank receives only its own shard.
    """
    pg = group or dist.group.WORLD
    src = dist.get_global_rank(pg, 0)
    is_src = dist.get_rank(pg) == 0
    holder: list[Any] = [_skeleton_or_error(full_optim_state_dict) if is_src else None]
    dist.broadcast_object_list(holder, src=src, group=pg)
    if isinstance(holder[0], str):  # rank 0's input is unusable: every rank raises, none waits
        raise ValueError(holder[0])
    skeleton: OsdT = holder[0]
    params = model_params(model)
    by_fqn = {p.fqn: p for p in params}
    check_names(skeleton["state"], by_fqn, "scatter_full_optim_state_dict")
    _check_spec_shapes(skeleton, by_fqn)
    full_states = full_optim_state_dict["state"] if is_src else None  # type: ignore[index]
    local = {"state": scatter_states(params, skeleton, full_states, pg, src), "param_groups": skeleton["param_groups"]}

    def wrap(p: Param, name: str, value: Any) -> Any:
        if p.unit is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value.clone() if isinstance(value, torch.Tensor) else value
        return _like_param(p, value)

    return _loadable(local, model, optim, optim_input, "scatter_full_optim_state_dict", wrap)


# --- rekey --------------------------------------------------------------------------------------------


def rekey_optim_state_dict(
    optim_state_dict: OsdT,
    optim_state_key_type: OptimStateKeyType | str,
    model: nn.Module,
    optim_input: Iterable[Any] | None = None,
    optim: torch.optim.Optimizer | None = None,
) -> OsdT:
    """Re-key ``optim_state_dict`` by parameter names (FQNs) or by parameter ids (positions in the optimizer).

    Ids count the optimizer's parameters in order: ``optim``'s, else ``optim_input``'s, else ``model.parameters()``.
    Works for wrapped and unwrapped models alike; values are not touched.
    """
    kind = coerce_enum(optim_state_key_type, OptimStateKeyType, arg="optim_state_key_type", allow_int=True)
    rows = target_rows(model, optim, optim_input, "rekey_optim_state_dict")
    order = [p for row in rows for p in row] if rows is not None else model_params(model)
    names = [p.fqn for p in order]
    if kind is OptimStateKeyType.PARAM_NAME:
        mapping: dict[Any, Any] = dict(enumerate(names))
        keep = str
    else:
        mapping = {name: i for i, name in enumerate(names)}
        keep = int

    def rekey(key: Any) -> Any:
        if isinstance(key, keep):
            return key
        if key not in mapping:
            raise ValueError(
                f"rekey_optim_state_dict: key {key!r} names no parameter of the model's {len(names)} parameters "
                "(in optimizer order). Pass the model (and optim) the state dict belongs to."
            )
        return mapping[key]

    state = {rekey(k): v for k, v in optim_state_dict["state"].items()}
    groups = [{**g, "params": [rekey(k) for k in g["params"]]} for g in optim_state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}

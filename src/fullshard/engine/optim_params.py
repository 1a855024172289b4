"""An optimizer's parameters as the model names them, and its state dict keyed by those names.

``Param`` is one parameter as the optimizer sees it: its FQN in the unwrapped model, the tensor the optimizer
holds (a unit's sharded parameter, maybe a DTensor, or a whole one outside any unit) and, inside a unit, its
``ParamGroup`` and ``ShardedParam``. ``model_params`` lists them in ``model.parameters()`` order, tied ones once;
``target_rows`` gives an optimizer's param groups as rows of them (a tensor the model does not own is refused,
naming why); ``named_state`` re-keys ``optim.state_dict()`` from integer ids to FQNs; ``check_names`` refuses a
dict keyed by ids or naming parameters the model lacks. ``is_elementwise`` and ``whole_names`` tell which states
are per-element (sharded like the parameter) and which whole on every rank (listed under ``WHOLE_STATES_KEY``).
Nothing here communicates. ``optim_state.py`` builds every form of the state dict on these; see its [Note:
optimizer state of a sharded parameter].
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.engine import state_dict as sd
from fullshard.engine.group import ParamGroup
from fullshard.engine.names import clean_key
from fullshard.engine.param import ShardedParam, local_tensor, replacement_for

__all__ = [
    "WHOLE_STATES_KEY",
    "OsdT",
    "Param",
    "check_names",
    "is_elementwise",
    "model_params",
    "named_state",
    "target_rows",
    "whole_names",
    "whole_value",
]

OsdT = dict[str, Any]
WHOLE_STATES_KEY = "fullshard_whole_states"


@dataclass(frozen=True)
class Param:
    """One parameter as the optimizer sees it, with its name in the unwrapped model."""

    fqn: str
    param: torch.Tensor  # what the optimizer holds: a sharded parameter (maybe a DTensor) or a whole one
    unit: ParamGroup | None  # the parameter group of its unit; None outside any unit
    sp: ShardedParam | None


def model_params(model: nn.Module) -> list[Param]:
    """``model``'s parameters in ``model.parameters()`` order (tied ones once), sharded ones as stepped on."""
    owners = sd.sharded_registrations(model)
    seen: set[int] = set()
    out = []
    for path, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            unit, sp = owners.get((id(module), name), (None, None))
            tensor = param if sp is None else sp.sharded_param
            if id(tensor) not in seen:
                seen.add(id(tensor))
                out.append(Param(clean_key(f"{path}.{name}" if path else name), tensor, unit, sp))
    return out


def _rows_from(model: nn.Module, param_lists: list[list[Any]], caller: str) -> list[list[Param]]:
    by_id = {id(p.param): p for p in model_params(model)}
    rows = []
    for params in param_lists:
        row = []
        for tensor in params:
            info = by_id.get(id(tensor))
            if info is None:
                raise ValueError(_foreign_param_message(tensor, caller))
            row.append(info)
        rows.append(row)
    return rows


def _foreign_param_message(tensor: torch.Tensor, caller: str) -> str:
    if replacement_for(tensor) is not None:
        return (
            f"{caller}: the optimizer holds the original parameters of a model that was sharded after the "
            "optimizer was created. Create the optimizer after wrapping, from the sharded model's parameters."
        )
    return (
        f"{caller}: the optimizer holds a parameter of shape {tuple(tensor.shape)} that is not a parameter of "
        "`model`. Pass the model whose parameters the optimizer was built from."
    )


def _optim_rows(model: nn.Module, optim: torch.optim.Optimizer, caller: str) -> list[list[Param]]:
    return _rows_from(model, [list(g["params"]) for g in optim.param_groups], caller)


def target_rows(
    model: nn.Module, optim: torch.optim.Optimizer | None, optim_input: Iterable[Any] | None, caller: str
) -> list[list[Param]] | None:
    """The optimizer's parameter groups (from ``optim``, else ``optim_input``), or None when neither is given."""
    if optim is not None:
        return _optim_rows(model, optim, caller)
    if optim_input is None:
        return None
    items = list(optim_input)
    if items and isinstance(items[0], dict):
        return _rows_from(model, [list(g["params"]) for g in items], caller)
    return _rows_from(model, [items], caller)


def is_elementwise(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def whole_names(groups: list[OsdT]) -> dict[str, set[str]]:
    """FQN -> the names of its states that are whole on every rank (listed in FQN-keyed ``groups``)."""
    out: dict[str, set[str]] = {}
    for group in groups:
        for fqn, names in zip(group["params"], group.get(WHOLE_STATES_KEY) or []):
            if names:
                out[fqn] = set(names)
    return out


def whole_value(p: Param, value: torch.Tensor) -> torch.Tensor:
    """A whole state as this rank holds it: a fresh tensor on the parameter's device."""
    whole = value.full_tensor() if isinstance(value, DTensor) else value
    return whole.to(local_tensor(p.param).device, copy=True)


def _named(osd: OsdT, rows: list[list[Param]], caller: str) -> tuple[dict[str, dict[str, Any]], list[OsdT]]:
    """``osd`` (``optim.state_dict()``: integer ids) as fqn -> state and param groups listing fqns."""
    groups = osd["param_groups"]
    ids = [i for g in groups for i in g["params"]]
    params = [p for row in rows for p in row]
    if len(groups) != len(rows) or len(ids) != len(params):
        raise ValueError(
            f"{caller}(optim_state_dict=...): it has {len(groups)} param groups of {len(ids)} parameters, but "
            f"the optimizer has {len(rows)} of {len(params)}. Pass optim.state_dict() of this optimizer, or None."
        )
    states = {p.fqn: osd["state"][i] for i, p in zip(ids, params) if i in osd["state"]}
    named_groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [p.fqn for p in row]}
        for g, row in zip(groups, rows)
    ]
    return states, named_groups


def named_state(
    model: nn.Module, optim: torch.optim.Optimizer, osd: OsdT | None, caller: str
) -> tuple[list[list[Param]], dict[str, dict[str, Any]], list[OsdT]]:
    """The optimizer's rows, and ``osd`` (default ``optim.state_dict()``) keyed by FQNs (see :func:`_named`)."""
    rows = _optim_rows(model, optim, caller)
    return (rows, *_named(optim.state_dict() if osd is None else osd, rows, caller))


def check_names(states: dict[Any, Any], params: dict[str, Param], caller: str) -> None:
    numeric = [k for k in states if not isinstance(k, str)]
    if numeric:
        raise ValueError(
            f"{caller}: the optimizer state dict is keyed by parameter ids ({numeric[:4]}...), but this method "
            "takes one keyed by parameter names. Re-key it first: FullyShardedDataParallel.rekey_optim_state_dict("
            "osd, OptimStateKeyType.PARAM_NAME, model)."
        )
    unknown = [k for k in states if k not in params]
    if unknown:
        raise ValueError(
            f"{caller}: the optimizer state dict has state for {unknown[:8]}, which are not parameters of the "
            f"model (whose parameters are e.g. {list(params)[:4]}). Load it into the model it was saved from."
        )

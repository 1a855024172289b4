"""Turning one module into a unit: find its parameters, validate them, shard them, attach the state.

Both entry points (``FullyShardedDataParallel`` and ``fully_shard``) end here, so there is one engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fullshard.engine.group import GroupPrecision, ParamGroup
from fullshard.engine.mesh import ShardGroup
from fullshard.engine.param import owner_label, replacement_for
from fullshard.engine.state import UnitConfig, UnitState, guard_direct_calls, unit_state

__all__ = ["Ignored", "build_unit", "resolve_device", "resolve_ignored"]

WRAPPED_NAME = "_fsdp_wrapped_module"


@dataclass(frozen=True)
class Ignored:
    """Modules and parameters a unit leaves alone: not sharded, their gradients not reduced."""

    module_ids: frozenset[int] = field(default_factory=frozenset)
    param_ids: frozenset[int] = field(default_factory=frozenset)


def resolve_ignored(
    root: nn.Module, ignored_modules: Iterable[nn.Module] | None, ignored_states: Iterable[object] | None
) -> Ignored:
    """Validate ``ignored_modules`` / ``ignored_states`` and collect what they cover."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "FullyShardedDataParallel got both ignored_modules and ignored_states; pass only one of them "
            "(ignored_states takes modules and parameters)."
        )
    modules: list[nn.Module] = []
    params: list[nn.Parameter] = []
    for item in list(ignored_modules or []) + list(ignored_states or []):
        if isinstance(item, nn.Parameter):
            params.append(item)
        elif isinstance(item, nn.Module):
            if unit_state(item) is not None:
                raise ValueError(
                    f"ignored module {type(item).__name__} is itself a sharded unit; ignore the module it wraps."
                )
            modules.append(item)
        else:
            raise TypeError(
                "ignored_modules/ignored_states must hold nn.Module or nn.Parameter objects, "
                f"got {type(item).__name__}."
            )
    for m in modules:
        params.extend(m.parameters())
    return Ignored(frozenset(id(m) for m in modules for m in m.modules()), frozenset(id(p) for p in params))


def resolve_device(device_id: int | torch.device | None, module: nn.Module) -> torch.device:
    """The compute device: ``device_id`` if given, else where the module is, else the backend's device."""
    if device_id is not None:
        if isinstance(device_id, int):
            return torch.device("cuda", device_id)
        if isinstance(device_id, (torch.device, str)):
            device = torch.device(device_id)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            return device
        raise TypeError(f"device_id={device_id!r} must be an int or a torch.device.")
    for p in module.parameters():
        if p.device.type not in ("cpu", "meta"):
            return p.device
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part != WRAPPED_NAME)


def _collect(
    unit_module: nn.Module, ignored: Ignored
) -> tuple[list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter]], list[tuple[str, nn.Module]]]:
    """The unit's own parameters (not those of units below it, nor ignored ones), and the modules holding them."""
    entries: dict[int, tuple[str, list[tuple[nn.Module, str]], nn.Parameter]] = {}
    holders: list[tuple[str, nn.Module]] = []
    stack: list[tuple[str, nn.Module]] = [("", unit_module)]
    while stack:
        prefix, module = stack.pop()
        holds = False
        for name, param in module._parameters.items():
            if param is None or id(param) in ignored.param_ids:
                continue
            fqn = _clean(prefix + name)
            _refuse_taken(param, fqn)
            if id(param) in entries:
                entries[id(param)][1].append((module, name))
            else:
                entries[id(param)] = (fqn, [(module, name)], param)
            holds = True
        if holds:
            holders.append((_clean(prefix.rstrip(".")) or type(unit_module).__name__, module))
        children = [
            (f"{prefix}{name}.", child)
            for name, child in module._modules.items()
            if child is not None and unit_state(child) is None and id(child) not in ignored.module_ids
        ]
        stack.extend(reversed(children))
    return list(entries.values()), holders


def _refuse_taken(param: nn.Parameter, fqn: str) -> None:
    owner = owner_label(param)
    if owner is not None:
        raise ValueError(
            f"parameter {fqn!r} is already sharded by unit {owner!r}. Shard bottom-up: wrap submodules first, "
            "then their parents (fully_shard(layer) for each layer, then fully_shard(model))."
        )
    if replacement_for(param) is not None:
        raise ValueError(
            f"parameter {fqn!r} is shared (tied) with a parameter that a unit below this one already sharded. "
            "Tied parameters must live in one unit: don't wrap the submodule holding the other use separately "
            "(e.g. keep the embedding and the output head that share a weight both in the root unit), or untie them."
        )


def build_unit(
    module: nn.Module,
    shard_group: ShardGroup,
    config: UnitConfig,
    *,
    ignored: Ignored,
    precision: GroupPrecision | None = None,
    use_dtensor: bool = False,
    guard_unit_module: bool = True,
    label: str | None = None,
) -> UnitState:
    """Shard ``module``'s own parameters into a group and attach a :class:`UnitState` to it."""
    entries, holders = _collect(module, ignored)
    label = label or type(module).__name__
    group = None
    if entries:
        for _, _, param in entries:
            if param.device.type == "meta":
                raise RuntimeError(
                    f"parameter {entries[0][0]!r} of {label} is on the meta device; materialize it before "
                    "sharding (module.to_empty(device=...) then reset_parameters()), or pass param_init_fn."
                )
            if param.device != shard_group.device:
                param.data = param.data.to(shard_group.device)
        group = ParamGroup(label, entries, shard_group, precision, use_dtensor=use_dtensor)
        guarded = [(n, m) for n, m in holders if guard_unit_module or m is not module]
        guard_direct_calls(label, group, guarded)
    return UnitState(module, group, config, label)

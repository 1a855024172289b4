"""What a state dict of a sharded module holds, and how a given one differs from it.

``expected_entries`` lists, for a module holding units, every clean key its ``state_dict()`` can have with the
full shape (``None``: extra state, not a tensor), the ``_flat_param`` key of each unit (a LOCAL state dict) with
the parameter keys it stands for, and the tensors no unit shards (persistent buffers, parameters outside any
unit); ``mismatches`` compares a state dict with that, as ``load_checked`` in ``state_dict.py`` does before
loading anything. ``sharded_registrations`` and ``extension_registrations`` map each ``(id(holder module),
attribute)`` to the unit parameter registered there; ``extension_params`` lists the tensor-subclass parameters
once each, by clean key. Keys are the unwrapped model's (see [Note: state dict hooks] in ``state_dict.py``).
Nothing here communicates or changes a module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fullshard.engine.extension import ExtensionParam, ExtensionParams
from fullshard.engine.group import ParamGroup
from fullshard.engine.names import clean_key
from fullshard.engine.param import ShardedParam
from fullshard.engine.unit_state import unit_state, unit_states_in

__all__ = [
    "FLAT_PARAM",
    "Expected",
    "expected_entries",
    "extension_params",
    "extension_registrations",
    "mismatches",
    "sharded_registrations",
]

FLAT_PARAM = "_flat_param"


@dataclass
class Expected:
    """What a state dict of a module holds: clean key -> full shape (``None``: not a tensor)."""

    shapes: dict[str, tuple[int, ...] | None]
    flats: dict[str, tuple[int, set[str]]]  # clean `_flat_param` key -> (G, the parameter keys it stands for)
    whole: dict[str, torch.Tensor]  # the tensors no unit shards (persistent buffers, parameters outside units)


def sharded_registrations(module: nn.Module) -> dict[tuple[int, str], tuple[ParamGroup, ShardedParam]]:
    """``(id(holder module), attribute)`` -> (group, sharded parameter) for every unit in ``module``."""
    return {
        (id(holder), name): (state.group, sp)
        for state in unit_states_in(module)
        if state.group is not None
        for sp in state.group.params
        for holder, name in sp.registrations
    }


def extension_registrations(module: nn.Module) -> dict[tuple[int, str], tuple[ExtensionParams, ExtensionParam]]:
    """``(id(holder module), attribute)`` -> (extension, parameter) for every extension parameter in ``module``'s
    units (tensor-subclass parameters: frozen quantized weights, trainable ones; see ``extension.py``)."""
    return {
        (id(holder), name): (state.group.extension, ep)
        for state in unit_states_in(module)
        if state.group is not None and state.group.extension is not None
        for ep in state.group.extension.params
        for holder, name in ep.registrations
    }


def extension_params(module: nn.Module) -> list[tuple[str, ExtensionParams, ExtensionParam]]:
    """Every extension parameter in ``module`` once (tied ones under their first name), with its clean key."""
    owners = extension_registrations(module)
    seen: set[int] = set()
    out = []
    for path, m in module.named_modules():
        for name in m._parameters:
            found = owners.get((id(m), name))
            if found is not None and id(found[1]) not in seen:
                seen.add(id(found[1]))
                out.append((clean_key(f"{path}.{name}" if path else name), *found))
    return out


def expected_entries(module: nn.Module) -> Expected:
    sharded = {key: sp for key, (_, sp) in sharded_registrations(module).items()}
    extension = {key: ep.shape for key, (_, ep) in extension_registrations(module).items()}
    shapes: dict[str, tuple[int, ...] | None] = {}
    whole: dict[str, torch.Tensor] = {}
    keys_of: dict[int, set[str]] = {}
    flat_units: list[tuple[str, ParamGroup]] = []
    for path, m in module.named_modules(remove_duplicate=False):
        base = path + "." if path else ""
        state = unit_state(m)
        if state is not None and state.group is not None:
            flat_units.append((clean_key(base + FLAT_PARAM), state.group))
        for name, p in m._parameters.items():
            if p is not None:
                sp = sharded.get((id(m), name))
                shapes[clean_key(base + name)] = sp.shape if sp is not None else tuple(p.shape)
                if sp is not None:
                    keys_of.setdefault(id(sp), set()).add(clean_key(base + name))
                elif (id(m), name) in extension:
                    shapes[clean_key(base + name)] = extension[(id(m), name)]
                else:
                    whole[clean_key(base + name)] = p
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                shapes[clean_key(base + name)] = tuple(b.shape)
                whole[clean_key(base + name)] = b
        if type(m).get_extra_state is not nn.Module.get_extra_state:
            shapes[clean_key(base + "_extra_state")] = None
    flats = {
        key: (group.flat_shard.numel(), set().union(*(keys_of.get(id(sp), set()) for sp in group.params)))
        for key, group in flat_units
    }
    return Expected(shapes, flats, whole)


def mismatches(module: nn.Module, state_dict: Mapping[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """Missing keys, unexpected keys and shape mismatches (as text) of ``state_dict`` against ``module``."""
    state_dict = {clean_key(k): v for k, v in state_dict.items()}
    want = expected_entries(module)
    covered = set().union(*(keys for k, (_, keys) in want.flats.items() if k in state_dict))
    missing = [k for k in want.shapes if k not in state_dict and k not in covered]
    unexpected = [k for k in state_dict if k not in want.shapes and k not in want.flats]
    shapes = []
    for key, shape in want.shapes.items():
        value = state_dict.get(key)
        if shape is not None and isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
            shapes.append(f"{key!r}: {tuple(value.shape)} in the state dict, {shape} in the model")
    return missing, unexpected, shapes

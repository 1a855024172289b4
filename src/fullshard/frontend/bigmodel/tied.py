"""Tied parameters: one ``nn.Parameter`` registered under several names (e.g. an embedding and an LM head)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["check_tied_parameters_on_same_device", "find_tied_parameters", "retie_parameters", "device_of"]


def find_tied_parameters(model: nn.Module, **_: Any) -> list[list[str]]:
    """Groups of names that share one parameter object, each group sorted (groups in first-name order)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [sorted(set(group)) for group in names.values() if len(set(group)) > 1]


def device_of(name: str, device_map: Mapping[str, Any]) -> Any:
    """The device ``device_map`` gives ``name``: its own entry or that of its nearest listed parent module."""
    probe = name
    while probe not in device_map:
        if not probe:
            raise ValueError(f"device_map has no entry for {name!r} nor for any module containing it.")
        probe = probe.rpartition(".")[0]
    return device_map[probe]


def check_tied_parameters_on_same_device(tied_params: list[list[str]], device_map: Mapping[str, Any]) -> None:
    """Warn for each tied group whose names ``device_map`` sends to different devices (they would be untied)."""
    for group in tied_params:
        devices = {name: device_of(name, device_map) for name in group}
        if len(set(map(str, devices.values()))) > 1:
            warnings.warn(
                f"Tied parameters are on different devices: {devices}. Put them on one device in the device_map "
                "(or use infer_auto_device_map, which keeps tied parameters together).",
                stacklevel=2,
            )


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_path, _, leaf = name.rpartition(".")
    return (model.get_submodule(module_path) if module_path else model), leaf


def retie_parameters(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Make every name of each group refer to one parameter again: the group's first one not on ``meta``."""
    for group in tied_params:
        params = [getattr(*_owner(model, name)) for name in group]
        keep = next((p for p in params if p.device != torch.device("meta")), None)
        if keep is None:
            continue
        for name in group:
            setattr(*_owner(model, name), keep)

"""``set_module_tensor_to_device``: replace one parameter or buffer of a module, by its full name;
``named_module_tensors``: a module's parameters, then its buffers.

``param.to(device)`` returns a new tensor that the module does not hold; this sets the module's entry itself.
A parameter stays an ``nn.Parameter`` of the same class with the same ``requires_grad``. With ``value`` the
shape must match the current tensor's (a mismatch means a wrong checkpoint, and is refused before anything
changes); the value is cast to ``dtype``, or else to the current tensor's dtype (integer and bool values keep
theirs when ``dtype`` is given, as in Accelerate).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["named_module_tensors", "set_module_tensor_to_device"]


def _device(device: Any) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: int | str | torch.device,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put ``module``'s tensor ``tensor_name`` on ``device`` (with ``value``'s data if given); see the module doc.

    ``fp16_statistics`` (8-bit quantisation) and ``clear_cache`` are accepted and unused. ``tied_params_map``
    maps a source tensor's ``data_ptr()`` to ``{device: tensor already placed}``: a tied weight met again is
    shared instead of copied.
    """
    owner_path, _, leaf = tensor_name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if leaf not in owner._parameters and leaf not in owner._buffers:
        raise ValueError(f"set_module_tensor_to_device: {type(owner).__name__} has no parameter or buffer {leaf!r}.")
    is_buffer = leaf in owner._buffers
    old = owner._buffers[leaf] if is_buffer else owner._parameters[leaf]
    if old is None:
        raise ValueError(f"set_module_tensor_to_device: {tensor_name!r} is None; there is nothing to move.")
    source = value if value is not None else old
    if tied_params_map is not None and device in tied_params_map.get(source.data_ptr(), {}):
        owner._parameters[leaf] = tied_params_map[source.data_ptr()][device]
        return
    if value is None and old.is_meta and _device(device).type != "meta":
        raise ValueError(f"set_module_tensor_to_device: {tensor_name!r} is on the meta device; pass value=...")
    if value is not None and tuple(value.shape) != tuple(old.shape):
        raise ValueError(
            f"set_module_tensor_to_device: value of shape {tuple(value.shape)} for {tensor_name!r}, which has shape "
            f"{tuple(old.shape)}. The checkpoint does not match the model."
        )
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    new = source if value is not None else old
    if value is not None and dtype is None:
        new = new.to(old.dtype)
    elif dtype is not None and new.is_floating_point():
        new = new.to(dtype)
    with torch.no_grad():
        new = new.to(_device(device), non_blocking=non_blocking)
    if is_buffer:
        owner._buffers[leaf] = new
    else:
        param_cls = type(old) if isinstance(old, nn.Parameter) else nn.Parameter
        owner._parameters[leaf] = param_cls(new, requires_grad=old.requires_grad)


def named_module_tensors(
    module: nn.Module, include_buffers: bool = True, recurse: bool = False, remove_non_persistent: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for ``module``'s parameters, then (``include_buffers``) its buffers, direct ones only
    unless ``recurse``; ``remove_non_persistent`` leaves out buffers that its state dict leaves out."""
    yield from module.named_parameters(recurse=recurse)
    if not include_buffers:
        return
    skipped: set[str] = set()
    if remove_non_persistent:
        owners = module.named_modules() if recurse else [("", module)]
        skipped = {f"{prefix}.{b}" if prefix else b for prefix, m in owners for b in m._non_persistent_buffers_set}
    for name, buffer in module.named_buffers(recurse=recurse):
        if name not in skipped:
            yield name, buffer

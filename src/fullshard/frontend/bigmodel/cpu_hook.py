"""``cpu_offload_with_hook``: a model kept on the CPU and moved to its execution device when it runs, until the
caller sends it back (a pipeline of models that take turns on one accelerator, as Accelerate's helper does)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fullshard.frontend.ops import send_to_device

__all__ = ["UserCpuOffloadHook", "cpu_offload_with_hook"]


class UserCpuOffloadHook:
    """What :func:`cpu_offload_with_hook` returns with the model: ``offload()`` sends the model back to the CPU,
    ``remove()`` stops moving it."""

    def __init__(self, model: nn.Module, handle: RemovableHandle, execution_device: torch.device) -> None:
        self.model, self.handle, self.execution_device = model, handle, execution_device

    def offload(self) -> None:
        self.model.to("cpu")

    def remove(self) -> None:
        self.handle.remove()


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: int | str | torch.device | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Put ``model`` on the CPU; each forward first offloads ``prev_module_hook``'s model (if given), then moves
    ``model`` and its inputs to ``execution_device`` (default: the first GPU, else the CPU), where ``model`` stays
    until ``hook.offload()``. Returns ``(model, hook)``."""
    if execution_device is None:
        execution_device = "cuda:0" if torch.cuda.is_available() else "cpu"
    device = torch.device(f"cuda:{execution_device}" if isinstance(execution_device, int) else execution_device)

    def before_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if prev_module_hook is not None:
            prev_module_hook.offload()
        module.to(device)
        return send_to_device(args, device), send_to_device(kwargs, device)

    model.to("cpu")
    handle = model.register_forward_pre_hook(before_forward, with_kwargs=True)
    return model, UserCpuOffloadHook(model, handle, device)

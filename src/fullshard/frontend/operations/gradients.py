"""Gradient helpers of the ``Accelerator`` beyond ``training.py``: forcing a reduction, clipping by value.

- :func:`trigger_sync`: inside ``no_sync`` (or an accumulation step of ``accumulate``), the backward run in
  this block reduces gradients anyway, as Accelerate's ``trigger_sync_in_backward`` does for DDP. Under FSDP
  Accelerate does nothing there; here every unit of the model reduces in that backward, so a loop that must
  synchronise on a step of its choosing (e.g. before an evaluation) can.
- :func:`clip_grad_value`: clamp every gradient element into ``[-clip_value, clip_value]``. The clamp is
  elementwise, so clamping each rank's shard equals clamping the full gradient: no communication is needed.
  (Accelerate refuses ``clip_grad_value_`` under FSDP; fullshard can do it exactly.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn

from fullshard.engine.state import gradient_sync

__all__ = ["clip_grad_value", "trigger_sync"]


def trigger_sync(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Reduce ``model``'s gradients in the backward run inside this block, whatever ``no_sync`` says outside it."""
    return gradient_sync(model, True)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad._local_tensor if hasattr(grad, "_local_tensor") else grad  # a DTensor's shard on this rank


def clip_grad_value(parameters: Iterable[torch.Tensor] | torch.Tensor, clip_value: float) -> None:
    """Clamp the gradients of ``parameters`` in place (this rank's shard of each); see the module docstring."""
    if not isinstance(clip_value, (int, float)) or isinstance(clip_value, bool) or clip_value < 0:
        raise ValueError(f"clip_grad_value_(clip_value={clip_value!r}): expected a number >= 0.")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for p in params:
        if p.grad is not None:
            _local(p.grad).clamp_(min=-clip_value, max=clip_value)

"""Gradient settings from Accelerate's handler objects: the fp16 loss scaler and gradient accumulation.

- :class:`GradScalerKwargs` becomes the arguments of the run's :class:`~fullshard.ShardedGradScaler` (fp16 only;
  with another precision there is no scaler and the handler changes nothing, as in Accelerate).
- :class:`GradientAccumulationPlugin` is the other way to say ``gradient_accumulation_steps``, plus three
  switches that :class:`~fullshard.frontend.data.gradient_state.GradientState` carries:

  - ``sync_with_dataloader`` (default ``True``): the last batch of a prepared loader always completes an
    accumulation step and restarts the count. ``False`` keeps counting across the loader's end.
  - ``sync_each_batch`` (default ``False``): reduce gradients on every batch, accumulation steps included
    (less memory for unsharded gradients, more communication). The optimizer still steps every ``num_steps``.
  - ``adjust_scheduler``: stored and reported. It changes no learning rate, here or in Accelerate 1.15: Accelerate
    reads it through ``to_kwargs()``, which drops default values, so its scheduler only ever sees ``False``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fullshard.algorithms.grad_scaler import ShardedGradScaler
from fullshard.frontend.handlers.base import KwargsHandler

__all__ = ["GradScalerKwargs", "GradientAccumulationPlugin", "build_scaler", "resolve_accumulation"]


@dataclass
class GradScalerKwargs(KwargsHandler):
    """``torch.amp.GradScaler``'s arguments, for the fp16 loss scaler (Accelerate's defaults)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """How many batches make one optimizer step, and when gradients are reduced (see the module docstring)."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


def build_scaler(handler: GradScalerKwargs | None, device: torch.device) -> ShardedGradScaler:
    """The fp16 loss scaler for ``device``, with ``handler``'s settings (torch's defaults without one)."""
    kwargs = handler.to_kwargs() if handler is not None else {}
    problems = [f"{k}={kwargs[k]!r}" for k in ("init_scale", "growth_factor") if k in kwargs and kwargs[k] <= 0]
    if "backoff_factor" in kwargs and not 0 < kwargs["backoff_factor"] < 1:
        problems.append(f"backoff_factor={kwargs['backoff_factor']!r}")
    if problems:
        raise ValueError(
            f"GradScalerKwargs({', '.join(problems)}): init_scale and growth_factor must be > 0 and backoff_factor "
            "in (0, 1) (the scale is multiplied by it after an overflow)."
        )
    return ShardedGradScaler(device=device.type, **kwargs)


def resolve_accumulation(plugin: GradientAccumulationPlugin | None, steps: int) -> GradientAccumulationPlugin:
    """The plugin an Accelerator runs with: ``plugin`` (checked) or one built from ``gradient_accumulation_steps``.

    Both at once is refused (as in Accelerate): it is not clear which count was meant.
    """
    if plugin is None:
        return GradientAccumulationPlugin(num_steps=steps)
    if not isinstance(plugin, GradientAccumulationPlugin):
        raise TypeError(
            f"Accelerator(gradient_accumulation_plugin={type(plugin).__name__}): expected a "
            "GradientAccumulationPlugin (from fullshard.utils import GradientAccumulationPlugin)."
        )
    if steps != 1:
        raise ValueError(
            f"Accelerator(gradient_accumulation_steps={steps}, gradient_accumulation_plugin=...): pass one of them; "
            f"put the count in the plugin: GradientAccumulationPlugin(num_steps={steps}, ...)."
        )
    n = plugin.num_steps
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"GradientAccumulationPlugin(num_steps={n!r}): expected an int >= 1 (1: no accumulation).")
    return plugin

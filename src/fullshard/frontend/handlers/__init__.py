"""Accelerate's kwargs handlers for gradients, DDP and profiling, and how an ``Accelerator`` picks them up.

- ``grad.py``: :class:`GradScalerKwargs` (the fp16 ``ShardedGradScaler``'s settings) and
  :class:`GradientAccumulationPlugin` (``Accelerator(gradient_accumulation_plugin=...)``).
- ``ddp.py``: :class:`DistributedDataParallelKwargs`, and what of it applies to a
  sharded model (the communication hook, under ``NO_SHARD``).
- ``profiling.py``: :class:`ProfileKwargs` and the ``Accelerator.profile`` context.
- ``autocast.py``: :class:`AutocastKwargs` (``torch.autocast``'s switches for the run's mixed precision).
- ``process_group.py``: :class:`InitProcessGroupKwargs`, and the answer for every handler not taken here.

:func:`collect_handlers` sorts the ``kwargs_handlers`` list by type. It only knows the types above; the
others (``InitProcessGroupKwargs``, ...) are handed back for their own modules to take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fullshard.frontend.handlers.autocast import AutocastKwargs
from fullshard.frontend.handlers.ddp import DDPCommunicationHookType, DistributedDataParallelKwargs
from fullshard.frontend.handlers.grad import GradientAccumulationPlugin, GradScalerKwargs
from fullshard.frontend.handlers.process_group import InitProcessGroupKwargs, process_group_kwargs
from fullshard.frontend.handlers.profiling import ProfileKwargs

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "Handlers",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
    "collect_handlers",
    "process_group_kwargs",
]


@dataclass
class Handlers:
    """The handlers of the types this package knows, at most one of each (``None`` when not given)."""

    scaler: GradScalerKwargs | None = None
    ddp: DistributedDataParallelKwargs | None = None
    profile: ProfileKwargs | None = None
    autocast: AutocastKwargs | None = None


_SLOTS = {
    GradScalerKwargs: "scaler",
    DistributedDataParallelKwargs: "ddp",
    ProfileKwargs: "profile",
    AutocastKwargs: "autocast",
}


def collect_handlers(kwargs_handlers: Any) -> tuple[Handlers, list[Any]]:
    """Sort ``kwargs_handlers`` (a list, or ``None``): the known ones into :class:`Handlers`, the rest returned.

    Two handlers of one type are refused by name, as Accelerate does: which one should win is not guessable.
    """
    if kwargs_handlers is None:
        return Handlers(), []
    if not isinstance(kwargs_handlers, (list, tuple)):
        raise TypeError(
            f"Accelerator(kwargs_handlers={type(kwargs_handlers).__name__}): expected a list of handler objects, "
            "e.g. kwargs_handlers=[GradScalerKwargs(init_scale=1024)]."
        )
    found, rest = Handlers(), []
    for handler in kwargs_handlers:
        slot = _SLOTS.get(type(handler))
        if slot is None:
            rest.append(handler)
        elif getattr(found, slot) is not None:
            raise ValueError(
                f"Accelerator(kwargs_handlers=[...]): two {type(handler).__name__} objects were given. Pass one, "
                "with every setting you want in it."
            )
        else:
            setattr(found, slot, handler)
    return found, rest

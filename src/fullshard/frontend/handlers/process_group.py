"""``InitProcessGroupKwargs`` and the handlers no other module of this package takes.

:class:`InitProcessGroupKwargs` is implemented (its ``backend``, ``init_method`` and ``timeout`` go to
``torch.distributed.init_process_group``). :func:`process_group_kwargs` gets the handlers that
:func:`~fullshard.frontend.handlers.collect_handlers` did not take (it takes fullshard's own gradient, DDP and
profiling handlers). Accelerate's handler classes reach it too, recognised by class name and fields without
importing accelerate: its ``InitProcessGroupKwargs`` is honoured; its handlers of a kind fullshard implements are
refused with the name of fullshard's class to pass instead; the rest are refused naming why they do not apply,
so that a script written for Accelerate gets a clear answer instead of a silent no-op.

Invariant: :func:`process_group_kwargs` returns only keys the user set, so what is left unset falls back to
the environment (``FULLSHARD_TIMEOUT``) and then to fullshard's defaults (see ``processes/runtime.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from fullshard.frontend.handlers.base import KwargsHandler

__all__ = ["InitProcessGroupKwargs", "process_group_kwargs"]


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments of ``torch.distributed.init_process_group``: ``backend``, ``init_method``, ``timeout``.

    ``None`` keeps fullshard's choice: gloo on CPU and NCCL on CUDA, ``env://`` under a launcher, and a timeout
    of ``FULLSHARD_TIMEOUT`` seconds if set, else 10 minutes. ``timeout`` bounds how long a rank waits in a
    collective for the others (a desynchronised or dead peer), after which it raises instead of hanging.
    """

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise TypeError(
                f"InitProcessGroupKwargs(timeout={self.timeout!r}): expected a datetime.timedelta, "
                "e.g. timeout=timedelta(minutes=5)."
            )
        if self.timeout is not None and self.timeout.total_seconds() <= 0:
            raise ValueError(f"InitProcessGroupKwargs(timeout={self.timeout}): expected a positive duration.")


# Accelerate's handlers that fullshard does not implement, and why.
# Handler kinds fullshard implements in its own classes (taken by collect_handlers before this module sees them).
_OWN_CLASS = ("DistributedDataParallelKwargs", "GradScalerKwargs", "GradientAccumulationPlugin", "ProfileKwargs")
_REFUSED = {
    "AutocastKwargs": "fullshard's autocast follows mixed_precision only",
    "FP8RecipeKwargs": "fullshard has no FP8 training",
    "AORecipeKwargs": "fullshard has no FP8 training",
    "TERecipeKwargs": "fullshard has no FP8 training",
    "MSAMPRecipeKwargs": "fullshard has no FP8 training",
}


def process_group_kwargs(handlers: Iterable[Any] | None) -> dict[str, Any]:
    """The ``init_process_group`` arguments the handlers set; raise for any other handler, naming it."""
    found: dict[str, Any] = {}
    for handler in handlers or ():
        name = type(handler).__name__
        if name in found:
            raise ValueError(f"Accelerator(kwargs_handlers=[...]): two {name}; pass each kind of handler once.")
        found[name] = handler
        if name in _OWN_CLASS:
            raise TypeError(
                f"Accelerator(kwargs_handlers=[{name}(...)]): got {type(handler).__module__}.{name}; pass fullshard's "
                f"own (from fullshard.utils import {name}), which fullshard knows how to apply."
            )
        if name in _REFUSED:
            raise TypeError(
                f"Accelerator(kwargs_handlers=[{name}(...)]): not supported, {_REFUSED[name]}. Remove it from "
                "kwargs_handlers (fullshard supports InitProcessGroupKwargs)."
            )
        elif name != "InitProcessGroupKwargs" or not hasattr(handler, "to_kwargs"):
            raise TypeError(
                f"Accelerator(kwargs_handlers=[{name}]): not a kwargs handler fullshard knows. Supported: "
                "InitProcessGroupKwargs (from fullshard.utils import InitProcessGroupKwargs)."
            )
    handler = found.get("InitProcessGroupKwargs")
    if handler is None:
        return {}
    kwargs = handler.to_kwargs()
    if type(handler).__module__.startswith("accelerate") and kwargs.get("timeout") == _accelerate_default(kwargs):
        kwargs.pop("timeout")  # Accelerate fills in its backend default; only an explicit value counts
    return {k: v for k, v in kwargs.items() if k in ("backend", "init_method", "timeout") and v is not None}


def _accelerate_default(kwargs: dict[str, Any]) -> timedelta:
    return timedelta(seconds=600 if kwargs.get("backend", "nccl") == "nccl" else 1800)

"""Accelerate's kwargs handlers: ``Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=...)])``.

fullshard implements :class:`InitProcessGroupKwargs` (its ``backend``, ``init_method`` and ``timeout`` go to
``torch.distributed.init_process_group``). Accelerate's other handlers are recognised by class name, so that a
script written for Accelerate gets a clear answer instead of a silent no-op: ``DistributedDataParallelKwargs``
is ignored with a warning (it configures DDP, and fullshard always shards, as Accelerate under FSDP ignores it
too); the rest are refused with a ``TypeError`` naming the class. Handlers may come from ``fullshard`` or from
``accelerate.utils`` (matched by class name and fields, without importing accelerate).

Invariant: :func:`process_group_kwargs` returns only keys the user set, so what is left unset falls back to
the environment (``FULLSHARD_TIMEOUT``) and then to fullshard's defaults (see ``runtime.py``).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

__all__ = [
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "process_group_kwargs",
]


class KwargsHandler:
    """Base of the handler dataclasses: :meth:`to_kwargs` gives the fields that differ from the defaults."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    def to_kwargs(self) -> dict[str, Any]:
        defaults = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if v != defaults[k]}


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


class DDPCommunicationHookType(str, enum.Enum):
    """DDP's gradient communication hooks (Accelerate's values)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """``torch.nn.parallel.DistributedDataParallel``'s arguments (unused by fullshard; see the module docstring)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)


# Accelerate's handlers that fullshard does not implement, and why.
_IGNORED = {
    "DistributedDataParallelKwargs": "it configures DistributedDataParallel; fullshard always shards the model "
    "(Accelerate ignores it under FSDP as well)",
}
_REFUSED = {
    "GradScalerKwargs": "fullshard's fp16 loss scaler takes no arguments yet",
    "AutocastKwargs": "fullshard's autocast follows mixed_precision only",
    "FP8RecipeKwargs": "fullshard has no FP8 training",
    "AORecipeKwargs": "fullshard has no FP8 training",
    "TERecipeKwargs": "fullshard has no FP8 training",
    "MSAMPRecipeKwargs": "fullshard has no FP8 training",
    "ProfileKwargs": "fullshard has no profiler integration; use torch.profiler directly",
}


def process_group_kwargs(handlers: Iterable[Any] | None) -> dict[str, Any]:
    """The ``init_process_group`` arguments the handlers set; warn for ignored ones, raise for refused ones."""
    found: dict[str, Any] = {}
    for handler in handlers or ():
        name = type(handler).__name__
        if name in found:
            raise ValueError(f"Accelerator(kwargs_handlers=[...]): two {name}; pass each kind of handler once.")
        found[name] = handler
        if name in _IGNORED:
            warnings.warn(f"Accelerator(kwargs_handlers=[{name}(...)]): ignored, {_IGNORED[name]}.", stacklevel=3)
        elif name in _REFUSED:
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

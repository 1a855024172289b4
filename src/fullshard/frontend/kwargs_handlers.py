"""Accelerate's kwargs handlers and other configuration objects that scripts build for features fullshard
covers differently or not at all.

- :class:`DistributedDataParallelKwargs` (with :class:`DDPCommunicationHookType`): DDP's settings. fullshard
  always shards the model (as Accelerate does under FSDP, where these are unused): ``Accelerator`` accepts them
  in ``kwargs_handlers`` and warns that they are ignored.
- :class:`DummyOptim`, :class:`DummyScheduler`, :class:`MegatronLMDummyScheduler`: placeholders for an
  optimizer or scheduler that a DeepSpeed or Megatron-LM config defines. Scripts import them and build them only
  when such a plugin is active (``accelerator.state.deepspeed_plugin`` is ``None`` here); building one raises.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "DummyOptim",
    "DummyScheduler",
    "MegatronLMDummyScheduler",
]


class DDPCommunicationHookType(str, enum.Enum):
    """DDP's gradient communication hooks (Accelerate's values)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class DistributedDataParallelKwargs:
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

    def to_kwargs(self) -> dict[str, Any]:
        """The fields that differ from their defaults (Accelerate's ``KwargsHandler.to_kwargs``)."""
        default = type(self)()
        return {k: v for k, v in vars(self).items() if getattr(default, k) != v}


class _ForeignPlaceholder:
    """Refuses to be built: the plugin that would fill it in does not exist in fullshard."""

    _plugin = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        raise RuntimeError(
            f"{name}(...): a placeholder for an object a {self._plugin} config defines; fullshard has no "
            f"{self._plugin} plugin (accelerator.state.deepspeed_plugin is None). Build a torch optimizer or "
            "scheduler instead, as the script does when no such plugin is active."
        )


class DummyOptim(_ForeignPlaceholder):
    _plugin = "DeepSpeed"


class DummyScheduler(_ForeignPlaceholder):
    _plugin = "DeepSpeed"


class MegatronLMDummyScheduler(_ForeignPlaceholder):
    _plugin = "Megatron-LM"

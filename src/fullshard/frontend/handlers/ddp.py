"""What ``DistributedDataParallelKwargs`` means for a sharded model.

Accelerate ignores the DDP handler under FSDP. Here one of its settings has a counterpart: under ``NO_SHARD``
(``fsdp_version=1``), where every rank holds the whole model and gradients are all-reduced as in DDP,
``comm_hook=DDPCommunicationHookType.FP16`` / ``BF16`` registers the engine's ``fp16_compress_hook`` /
``bf16_compress_hook`` (gradients travel in 16 bits, then are cast back), as DDP's hooks of those names do.

Everything else describes DDP's reducer (buckets, unused-parameter search, static graphs, per-forward buffer
broadcast), which the engine does not have: such settings are reported in one warning, from rank 0, and change
nothing. PowerSGD keeps per-bucket error state that has no counterpart here; asking for it is refused rather
than silently ignored, because the run would otherwise communicate and converge differently than asked.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fullshard.algorithms.comm_hooks import LowPrecisionState, bf16_compress_hook, fp16_compress_hook
from fullshard.engine import FullyShardedDataParallel, ShardingStrategy
from fullshard.frontend.handlers.base import KwargsHandler

__all__ = ["DDPCommunicationHookType", "DistributedDataParallelKwargs", "apply_ddp_kwargs"]


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


_HOOKS = {
    DDPCommunicationHookType.FP16: (torch.float16, fp16_compress_hook),
    DDPCommunicationHookType.BF16: (torch.bfloat16, bf16_compress_hook),
}


def _hook_type(value: object, field: str) -> DDPCommunicationHookType:
    try:
        return DDPCommunicationHookType(str(getattr(value, "value", value)))
    except ValueError:
        choices = ", ".join(repr(m.value) for m in DDPCommunicationHookType)
        raise ValueError(f"DistributedDataParallelKwargs({field}={value!r}): expected one of {choices}.") from None


def apply_ddp_kwargs(model: nn.Module, handler: DistributedDataParallelKwargs | None, *, is_main: bool) -> None:
    """Apply what of ``handler`` applies to the prepared ``model`` (see the module docstring); warn of the rest."""
    if handler is None:
        return
    asked = handler.to_kwargs()
    hook = _hook_type(asked.pop("comm_hook", DDPCommunicationHookType.NO), "comm_hook")
    wrapper = _hook_type(asked.pop("comm_wrapper", DDPCommunicationHookType.NO), "comm_wrapper")
    asked.pop("comm_state_option", None)
    no_shard = isinstance(model, FullyShardedDataParallel) and model.sharding_strategy is ShardingStrategy.NO_SHARD
    if hook in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD) or (
        wrapper is not DDPCommunicationHookType.NO
    ):
        raise ValueError(
            f"DistributedDataParallelKwargs(comm_hook={hook.value!r}, comm_wrapper={wrapper.value!r}): PowerSGD "
            "keeps per-bucket state that fullshard's gradient reduction does not have. Use comm_hook='fp16' or "
            "'bf16' (with FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy='NO_SHARD')), or none."
        )
    if hook in _HOOKS and no_shard:
        dtype, fn = _HOOKS[hook]
        # The group is passed explicitly: the engine's collectives read ``None`` as "no group" (one rank).
        model.register_comm_hook(LowPrecisionState(dist.group.WORLD, parameter_type=dtype), fn)
    elif hook in _HOOKS:
        asked["comm_hook"] = hook.value
    if asked and is_main:
        where = "under NO_SHARD" if no_shard else "on a sharded model (only comm_hook applies, under NO_SHARD)"
        warnings.warn(
            f"DistributedDataParallelKwargs: {sorted(asked)} configure DDP's reducer, which a model prepared by "
            f"fullshard does not use; they are ignored {where}.",
            stacklevel=3,
        )

"""Ready-made communication hooks for ``FullyShardedDataParallel.register_comm_hook``.

Signatures follow torch's FSDP: a sharded strategy calls ``hook(state, grad, output)`` where ``grad`` is
the flat unsharded gradient (every rank's chunk, rank-major) and ``output`` receives this rank's reduced
chunk; NO_SHARD calls ``hook(state, grad)`` to all-reduce ``grad`` in place. Every hook here averages over
the state's process group, dividing by ``gradient_predivide_factor`` before the collective and by
``gradient_postdivide_factor`` after it, so that their product is the world size (which keeps low-precision
sums from overflowing on large worlds).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fullshard.engine import all_reduce_flat, predivide_factor, reduce_scatter_flat

__all__ = [
    "DefaultState",
    "LowPrecisionState",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "reduce_scatter_hook",
]


class DefaultState:
    """The process group a hook reduces over and how it splits the averaging around the collective."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        # None means the default group, as in torch; the engine's collectives read None as "no group" (one rank).
        self.process_group = dist.group.WORLD if process_group is None else process_group
        world = dist.get_world_size(self.process_group)
        self.world_size = world
        self.gradient_predivide_factor = predivide_factor(world)
        self.gradient_postdivide_factor = world / self.gradient_predivide_factor


class LowPrecisionState(DefaultState):
    """As :class:`DefaultState`; gradients travel in ``parameter_type`` (e.g. ``torch.float16``)."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, parameter_type: torch.dtype = torch.float16):
        super().__init__(process_group)
        if not parameter_type.is_floating_point:
            raise ValueError(f"LowPrecisionState(parameter_type={parameter_type}) must be a floating-point dtype.")
        self.parameter_type = parameter_type


def allreduce_hook(state: DefaultState, grad: torch.Tensor) -> None:
    """Average ``grad`` over ``state.process_group`` in place (NO_SHARD)."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    all_reduce_flat(grad, state.process_group, async_op=False)
    if state.gradient_postdivide_factor > 1:
        grad.div_(state.gradient_postdivide_factor)


def reduce_scatter_hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """Average ``grad`` over ``state.process_group`` and keep this rank's chunk in ``output``."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    reduce_scatter_flat(output, grad, state.process_group, async_op=False)
    if state.gradient_postdivide_factor > 1:
        output.div_(state.gradient_postdivide_factor)


def _low_precision_hook(
    dtype: torch.dtype, state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None
) -> None:
    low_grad = grad.to(dtype)
    if output is None:
        allreduce_hook(state, low_grad)
        grad.copy_(low_grad)
        return
    low_out = torch.empty(output.shape, dtype=dtype, device=output.device)
    reduce_scatter_hook(state, low_grad, low_out)
    output.copy_(low_out)


def fp16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """Reduce in float16 (half the bytes of float32), then cast back to the gradient's dtype."""
    _low_precision_hook(torch.float16, state, grad, output)


def bf16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """Reduce in bfloat16 (half the bytes of float32), then cast back to the gradient's dtype."""
    _low_precision_hook(torch.bfloat16, state, grad, output)

"""What modules compute with while a unit is gathered: every parameter's view of the unit's flat full buffer
(``flat_full``), made by one autograd node whose backward writes the whole flat gradient at once.

``flat_full`` is one autograd leaf per unit (see ``group.py``); its one ``AccumulateGrad`` then fires once per
backward, the unit's post-backward signal. This node keeps that true while making the views cheaply.
"""

from __future__ import annotations

from typing import Any

import torch

from fullshard.engine.layout import contiguous_strides
from fullshard.engine.param import ShardedParam

__all__ = ["FullViews", "FullViewsPlan"]


class FullViewsPlan:
    """Where each parameter lies in ``flat_full`` (layout order), for :class:`FullViews`: fixed for a group's life.

    ``views``: per parameter, the shape, contiguous strides and offset of its real elements (its block's first
    ``numel``); ``pieces``: per parameter, its ``numel`` and the padding after it in its block (0 for none).
    ``padding_zeros`` holds, per ``(dtype, device)`` of ``flat_full``, one zeros piece per padded parameter (views of
    one zeros buffer as long as the largest padding), made at the first backward and only ever read.
    ``received``: per parameter, whether a gradient reached its view since :meth:`take_received` (a parameter no
    output used gets none, and its ``.grad`` stays ``None``, as without sharding).
    """

    def __init__(self, ordered: list[ShardedParam], world: int) -> None:
        self.views: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
        self.pieces: list[tuple[int, int]] = []
        self.shard_dims = [sp.shard_dim for sp in ordered]  # Shard(d) parameters: permuted views of their blocks
        for sp in ordered:
            lay = sp.layout
            # the block holds the parameter with its shard dim first (see [Note: Shard(d)] in param.py): its view in
            # the parameter's dim order has the moved shape's contiguous strides, permuted the same way
            strides = sp.unmove_shape(contiguous_strides(lay.shape))
            self.views.append((sp.gathered_shape, strides, world * sp.offset))
            self.pieces.append((lay.numel, world * lay.padded_shard_numel - lay.numel))
        self.padding_zeros: dict[tuple[torch.dtype, torch.device], list[torch.Tensor | None]] = {}
        self.received = [False] * len(self.pieces)

    def take_received(self) -> list[bool]:
        """Which parameters got a gradient since the last call (layout order); starts afresh."""
        received, self.received = self.received, [False] * len(self.pieces)
        return received

    def zeros_for_padding(self, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor | None]:
        key = (dtype, device)
        zeros = self.padding_zeros.get(key)
        if zeros is None:
            longest = max((padding for _, padding in self.pieces), default=0)
            with torch.no_grad():
                buffer = torch.zeros(longest, dtype=dtype, device=device)
                zeros = [buffer[:padding] if padding else None for _, padding in self.pieces]
            self.padding_zeros[key] = zeros
        return zeros


class FullViews(torch.autograd.Function):
    """Every parameter's view of ``flat_full``, in its shape, as one autograd node (what modules compute with).

    Forward: one ``as_strided`` per parameter straight to its shape (``torch.split`` would cost one more view per
    parameter, and per padding piece). Backward: ``flat_full``'s gradient in one ``cat`` of the parameters'
    gradients (flattened) and, for the padding of each block, kept zeros (:meth:`FullViewsPlan.zeros_for_padding`),
    where ``split``'s backward allocated and filled one zeros tensor per padded parameter at every backward. A
    parameter without a gradient (frozen, or unused in this forward) gets zeros, as under ``split``: the gradient is
    the same tensor, bit for bit; the plan records which parameters did get one (``FullViewsPlan.received``). The
    views cannot be modified in place (as ``split``'s could not).
    """

    @staticmethod
    def forward(ctx: Any, flat_full: torch.Tensor, plan: FullViewsPlan) -> tuple[torch.Tensor, ...]:
        ctx.plan = plan
        ctx.dtype_device = (flat_full.dtype, flat_full.device)  # its gradient's, as autograd checks
        ctx.set_materialize_grads(False)  # no zeros allocated for the outputs without a gradient (see backward)
        base = flat_full.storage_offset()
        return tuple(flat_full.as_strided(shape, stride, base + offset) for shape, stride, offset in plan.views)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        plan: FullViewsPlan = ctx.plan
        dtype, device = ctx.dtype_device
        padding_zeros = plan.zeros_for_padding(dtype, device)
        pieces = []
        received = plan.received
        for i, (grad, (numel, _), zeros, dim) in enumerate(zip(grads, plan.pieces, padding_zeros, plan.shard_dims)):
            if grad is None:
                pieces.append(torch.zeros(numel, dtype=dtype, device=device))
            elif dim:
                received[i] = True
                pieces.append(grad.movedim(dim, 0).reshape(-1))
            else:
                received[i] = True
                pieces.append(grad.view(-1) if grad.is_contiguous() else grad.reshape(-1))
            if zeros is not None:
                pieces.append(zeros)
        return torch.cat(pieces), None

"""FrozenBackward: when a unit without trainable parameters is done with backward, so that it can be freed then.

A unit whose parameters are all frozen (a LoRA model's final norm and LM head, a frozen decoder layer) gets no
gradient of its own, so the signal that ends a trainable unit's backward (``flat_full``'s gradient accumulated,
see [Note: group buffers] in ``group.py``) never comes, and once gathered for backward it stayed gathered until the
root's final callback: through the whole rest of backward. With no trainable parameter, every backward path through
such a unit starts at one of its inputs, so its backward is over once the gradients of all its forward calls'
inputs that require grad have been computed. Each forward call passes those inputs through an identity autograd
function (:class:`_Signal`) whose backward counts the call done; when every call of this iteration is done, the
unit's ``on_done`` runs (it frees the gathered parameters). An input whose gradient never comes leaves the unit
gathered until the final callback, as before. torch's FSDP2 frees such units the same way (a function on the
forward inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["FrozenBackward"]


class _Signal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, on_backward: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.on_backward = on_backward
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.on_backward()
        return (None, *grads)


class FrozenBackward:
    """Counts one unit's forward calls this iteration and their backwards; see the module docstring."""

    def __init__(self, on_done: Callable[[], None]) -> None:
        self.on_done = on_done
        self.calls = 0  # forward calls whose inputs were passed through _Signal this iteration
        self.done = 0  # ... whose inputs' gradients have been computed

    def wrap(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` with the floating tensors that require grad passed through :class:`_Signal`."""
        leaves, spec = tree_flatten((args, kwargs))
        chosen = [
            i
            for i, leaf in enumerate(leaves)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point()
        ]
        if not chosen:
            return args, kwargs
        self.calls += 1
        outputs = _Signal.apply(self._one_done, *(leaves[i] for i in chosen))
        for i, out in zip(chosen, outputs, strict=True):
            leaves[i] = out
        return tree_unflatten(leaves, spec)

    def _one_done(self) -> None:
        self.done += 1
        if self.done == self.calls:
            self.on_done()

    def reset(self) -> None:
        """A new iteration (or an aborted one) starts counting from zero."""
        self.calls = self.done = 0

"""Activation checkpointing for (parts of) sharded models: non-reentrant ``torch.utils.checkpoint``.

``apply_activation_checkpointing(model, check_fn)`` makes every submodule for which ``check_fn`` is true
recompute its forward during backward instead of keeping its activations. Module names and parameters are
unchanged (no wrapper module is inserted, so state-dict keys stay the same). It composes with units in
either order: recomputation inside a unit runs after the unit's pre-backward has gathered its
parameters, and a unit recomputed as a whole is only gathered (never re-hooked) by that forward. Units inside
the recomputed module (LoRA's projections inside a decoder layer) are gathered one after another for the
recomputation and freed again, as in forward, until their own backward gathers them (the engine's
[Note: recomputation frees what it gathered]); so a recomputed layer never holds all its units at once.

A Hugging Face decoder layer (a subclass of transformers' ``GradientCheckpointingLayer``) is checkpointed through
transformers' own switch instead of a wrapper, so that it behaves as under ``model.gradient_checkpointing_enable()``:
recomputed only in training with gradients on, and without the KV cache. A wrapped layer would be handed the cache
the model builds (``use_cache`` is true by default) and write into it twice, once in forward and again in the
recomputation: the returned cache then holds every position twice, and each layer's cache tensors stay alive, held
by the checkpoint's saved arguments, until backward ends (1 MiB per layer of a 2048-wide Llama at 64 tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint
from torch import nn

__all__ = ["apply_activation_checkpointing", "checkpoint_module"]

_MARK = "_fullshard_checkpointed"


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Make ``module``'s forward recompute in backward (idempotent); return ``module``.

    A transformers decoder layer is switched on the way transformers does it (see the module docstring), and left as
    it is when ``gradient_checkpointing_enable()`` switched it on already (never recomputed twice over); any other
    module's forward is wrapped in non-reentrant ``torch.utils.checkpoint``."""
    if _is_transformers_checkpointing_layer(module):  # transformers' switch is the state: no mark of ours
        if not module.gradient_checkpointing:  # on already (gradient_checkpointing_enable): the user's function stays
            module.gradient_checkpointing = True
            module._gradient_checkpointing_func = functools.partial(
                torch.utils.checkpoint.checkpoint, use_reentrant=False
            )
        return module
    if getattr(module, _MARK, False):
        return module
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed  # type: ignore[method-assign]
    setattr(module, _MARK, True)
    return module


def _is_transformers_checkpointing_layer(module: nn.Module) -> bool:
    """True for a subclass of transformers' ``GradientCheckpointingLayer`` (by name: transformers is not imported)."""
    return any(
        cls.__name__ == "GradientCheckpointingLayer" and cls.__module__.startswith("transformers.")
        for cls in type(module).__mro__
    )


def apply_activation_checkpointing(model: nn.Module, check_fn: Callable[[nn.Module], bool]) -> int:
    """Checkpoint every submodule of ``model`` (itself included) with ``check_fn(module)`` true.

    Returns how many modules were checkpointed, so a ``check_fn`` that matches nothing is easy to spot.
    """
    matched = [m for m in model.modules() if check_fn(m)]
    for module in matched:
        checkpoint_module(module)
    return len(matched)

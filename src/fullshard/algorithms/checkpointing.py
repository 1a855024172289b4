"""Activation checkpointing for (parts of) sharded models: non-reentrant ``torch.utils.checkpoint``.

``apply_activation_checkpointing(model, check_fn)`` makes every submodule for which ``check_fn`` is true
recompute its forward during backward instead of keeping its activations. Module names and parameters are
unchanged (no wrapper module is inserted, so state-dict keys stay the same). It composes with units in
either order: recomputation inside a unit runs after the unit's pre-backward has gathered its
parameters, and a unit recomputed as a whole is only gathered (never re-hooked) by that forward. Units inside
the recomputed module (LoRA's projections inside a decoder layer) are gathered one after another for the
recomputation and freed again, as in forward, until their own backward gathers them (the engine's
[Note: recomputation frees what it gathered]); so a recomputed layer never holds all its units at once.
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
    """Make ``module``'s forward recompute in backward (idempotent); return ``module``."""
    if getattr(module, _MARK, False):
        return module
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed  # type: ignore[method-assign]
    setattr(module, _MARK, True)
    return module


def apply_activation_checkpointing(model: nn.Module, check_fn: Callable[[nn.Module], bool]) -> int:
    """Checkpoint every submodule of ``model`` (itself included) with ``check_fn(module)`` true.

    Returns how many modules were checkpointed, so a ``check_fn`` that matches nothing is easy to spot.
    """
    matched = [m for m in model.modules() if check_fn(m)]
    for module in matched:
        checkpoint_module(module)
    return len(matched)

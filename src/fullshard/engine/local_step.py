"""Element-wise optimizers step on the local tensors of ``fully_shard``'s ``DTensor`` parameters.

[Note: local optimizer steps]
Under ``fully_shard`` each sharded parameter, its gradient and its optimizer state are ``DTensor``\\ s, as in torch
FSDP2. An element-wise optimizer (AdamW, SGD, ...) computes the same thing on each rank's rows as on the whole
tensor, but stepping it on ``DTensor``\\ s costs one Python ``__torch_dispatch__`` per operation and parameter:
on CPU, where torch's optimizers default to their per-parameter loop, about nine per parameter, 450 a step for the
small benchmark GPT (4 x 256), a tenth of its step. So for the optimizers in :data:`ELEMENTWISE` (exact classes:
a subclass may compute anything in its ``step``), a global step pre-hook swaps each sharded parameter in the param
groups for its local tensor, with the local gradient as its ``.grad`` and its state keyed by it with local tensors
(the same storage: nothing is copied), and the global post-hook puts everything back, wrapping a per-element state
the step created (same shape as the local tensor) in a ``DTensor`` laid out as its parameter, as the ``DTensor``
step would have made it. The kernels and their inputs are the same, so the results are bitwise those of the
``DTensor`` step; between steps nothing differs (state dicts, checkpoints, resharding).

Invariants and limits:

- An optimizer is swapped whole or not at all: every parameter is either a plain tensor or one of fullshard's
  sharded ``DTensor`` parameters whose gradient (if any) and per-element states are ``DTensor``\\ s laid out as it
  (anything else: the optimizer steps on ``DTensor``\\ s, as before). Not swapped either: a step with a closure (it
  recomputes gradients inside the step), ``differentiable`` groups, a step under ``torch.compile``, an optimizer
  whose parameters are stepped whole (``exclude``: ``algorithms/whole_step.py``), and
  ``FULLSHARD_LOCAL_OPTIMIZER_STEP=0``.
- Global pre-hooks run before an optimizer's own pre-hooks and global post-hooks after its own post-hooks, so an
  optimizer's own step hooks see the local tensors.
- A step that raises leaves its optimizer swapped until the next of: its next step, its ``state_dict()`` or
  ``load_state_dict()``, the root's next forward. Restoring keeps what ``zero_grad()`` did meanwhile to the local
  gradients (set to ``None``: the parameter's gradient too).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fullshard.engine.mesh import ShardGroup
from fullshard.engine.param import local_tensor, owner_label

__all__ = ["ELEMENTWISE", "ENV_VAR", "exclude", "install", "restore_all"]

ENV_VAR = "FULLSHARD_LOCAL_OPTIMIZER_STEP"

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.Adadelta,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)


@dataclass
class _Swap:
    """What one swapped step changed: each group's own ``params`` list, and each sharded parameter with its local
    tensor and its state as it was (``None``: it had none)."""

    lists: list[tuple[dict[str, Any], list[torch.Tensor]]] = field(default_factory=list)
    params: list[tuple[DTensor, torch.Tensor, dict[str, Any] | None]] = field(default_factory=list)


_SWAPPED: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Swap] = weakref.WeakKeyDictionary()
_EXCLUDED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_HOOKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # state-dict hooks registered
_INSTALLED = False


def install() -> None:
    """Register the global step hooks (once; ``fully_shard`` calls it once it has made ``DTensor`` parameters)."""
    global _INSTALLED
    if not _INSTALLED:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _INSTALLED = True


def exclude(optimizer: torch.optim.Optimizer) -> None:
    """Never swap ``optimizer``: its own step hooks need the ``DTensor`` parameters (whole-parameter steps)."""
    _EXCLUDED.add(optimizer)


def restore_all() -> None:
    """Put back every optimizer a raised step left swapped (cheap when none is)."""
    if not _SWAPPED:
        return
    for optimizer in list(_SWAPPED.keys()):
        _restore(optimizer)


def _is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor) and owner_label(tensor) is not None


def _local_like(value: Any, param: DTensor) -> torch.Tensor | None:
    """``value``'s local tensor if it is a ``DTensor`` laid out as ``param``; else ``None``."""
    if not isinstance(value, DTensor):
        return None
    spec, like = value._spec, param._spec
    # Sharded gradients share their parameter's spec (mesh.ShardGroup.dtensor_like): no comparison for them.
    if spec is not like and (
        spec.placements != like.placements or (spec.mesh is not like.mesh and spec.mesh != like.mesh)
    ):
        return None
    local = value._local_tensor
    return local if local.shape == param._local_tensor.shape else None


def _swappable(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> bool:
    if type(optimizer) not in ELEMENTWISE or optimizer in _EXCLUDED:
        return False
    if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:  # args[0] is the optimizer
        return False
    if torch.compiler.is_compiling() or os.environ.get(ENV_VAR, "1") == "0":
        return False
    return not any(group.get("differentiable", False) for group in optimizer.param_groups)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _restore(optimizer)  # a step that raised left it swapped
    if not _swappable(optimizer, args, kwargs):
        return
    # Decide first, change nothing until every parameter qualifies.
    state = optimizer.state
    sharded: list[DTensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            if not _is_sharded(p):
                return  # a DTensor fullshard does not own (its layout is someone else's)
            if p.grad is not None and _local_like(p.grad, p) is None:
                return
            if p in state:
                for value in state[p].values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and _local_like(value, p) is None:
                        return
            sharded.append(p)
    if not sharded:
        return
    swap = _Swap()
    for group in optimizer.param_groups:
        params = group["params"]
        swap.lists.append((group, params))
        group["params"] = [local_tensor(p) for p in params]
    for p in sharded:
        local = p._local_tensor
        before = state.get(p)
        if before is not None:
            state[local] = {k: local_tensor(v) for k, v in before.items()}
        local.grad = None if p.grad is None else p.grad._local_tensor
        swap.params.append((p, local, before))
    _SWAPPED[optimizer] = swap
    if optimizer not in _HOOKED:
        optimizer.register_state_dict_pre_hook(_restore)
        optimizer.register_load_state_dict_pre_hook(lambda opt, _sd: _restore(opt))
        _HOOKED.add(optimizer)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _restore(optimizer)


def _restore(optimizer: torch.optim.Optimizer) -> None:
    swap = _SWAPPED.pop(optimizer, None)
    if swap is None:
        return
    for group, params in swap.lists:
        group["params"] = params
    state = optimizer.state
    for p, local, before in swap.params:
        stepped = state.pop(local, None)
        if stepped:
            restored = {k: _as_param_state(k, v, p, local, before) for k, v in stepped.items()}
            if before is None:
                state[p] = restored
            else:  # the same dict object as before the step: a reference to it stays valid, as without the swap
                before.clear()
                before.update(restored)
        if local.grad is None:
            p.grad = None  # zero_grad() after a step that raised
        local.grad = None


def _as_param_state(key: str, value: Any, param: DTensor, local: torch.Tensor, before: dict[str, Any] | None) -> Any:
    """A state value as the ``DTensor`` step leaves it: the original ``DTensor`` where the step updated its local
    tensor in place, a new per-element tensor as a ``DTensor`` laid out as ``param``, anything else as it is."""
    old = before.get(key) if before is not None else None
    if isinstance(old, DTensor) and old._local_tensor is value:
        return old
    new_per_element = isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0
    if new_per_element and value.shape == local.shape:
        return ShardGroup.dtensor_like(value.contiguous(), param)
    return value

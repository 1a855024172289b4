"""Create an optimizer's per-parameter state before its first step, so a checkpoint can be loaded into it.

[Note: loading into a fresh optimizer]
``torch.distributed.checkpoint`` loads in place: it fills the tensors of a template state dict and cannot
create entries the template lacks. A torch optimizer creates its per-parameter state (``exp_avg``,
``momentum_buffer``, ``step``, ...) lazily, in its first ``step()``, so the optimizer state dict of a fresh
process is empty and has nothing for ``load_sharded`` to fill. :func:`init_optimizer_state` lets the
optimizer create that state itself, with the right types, dtypes and (sharded) shapes, and leaves
everything else as it found it.

How: the parameters lacking state get zero gradients, every other parameter's gradient is set to ``None``
(optimizers skip those), every learning rate is set to 0, and ``optimizer.step()`` runs once. Afterwards
the learning rates and gradients are put back, the stepped parameters are copied back from a snapshot
(so that no optimizer, whatever it does with a zero learning rate, can change them), and every tensor of
the new state is zeroed. Zero state with ``step == 0`` is what Adam/AdamW hold before their first step
and SGD's momentum behaves the same from it (``dampening=0``), but it is a template: load a checkpoint
into it. Step hooks registered on the optimizer run during that one step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["init_optimizer_state"]


def _params_without_state(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [
        p for group in optimizer.param_groups for p in group["params"] if p.requires_grad and p not in optimizer.state
    ]


def _check_optimizer(optimizer: object) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer) or not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"init_optimizer_state(optimizer={type(optimizer).__name__}): expected a torch.optim.Optimizer "
            "(pass the optimizer itself, e.g. accelerated_optimizer.optimizer)."
        )


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """Create zero-valued state for every parameter of ``optimizer`` that has none; return those that got some.

    Works on any optimizer over sharded parameters (``fully_shard``'s DTensors, a wrapper's local shards)
    or plain ones; not a collective. Postconditions: every parameter that requires grad has state; the
    parameters' values, their ``.grad``, the param groups (learning rates included) and the state that
    existed before are unchanged; the new state's tensors are all zero. Optimizers that keep no state for
    some parameters (SGD without momentum) keep none for them here either. See [Note: loading into a fresh
    optimizer]. Optimizers that need a closure (LBFGS) are not supported.
    """
    _check_optimizer(optimizer)
    targets = _params_without_state(optimizer)
    if not targets:
        return []
    every = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in every]
    lrs = [group.get("lr") for group in optimizer.param_groups]
    with torch.no_grad():
        snapshot = [p.detach().clone() for p in targets]
    try:
        for p in every:
            p.grad = None
        for p in targets:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
        optimizer.step()
    finally:
        _restore(optimizer, every, grads, lrs, targets, snapshot)
    return _zero_state(optimizer, targets)


def _restore(
    optimizer: torch.optim.Optimizer,
    every: list[nn.Parameter],
    grads: list[torch.Tensor | None],
    lrs: list[Any],
    targets: list[nn.Parameter],
    snapshot: list[torch.Tensor],
) -> None:
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if "lr" in group:
            group["lr"] = lr
    for p, grad in zip(every, grads, strict=True):
        p.grad = grad
    with torch.no_grad():
        for p, saved in zip(targets, snapshot, strict=True):
            p.copy_(saved)


def _zero_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Zero the state of ``params``; return those that have state (SGD without momentum keeps none)."""
    created = [p for p in params if p in optimizer.state]
    with torch.no_grad():
        for p in created:
            for value in optimizer.state[p].values():
                if torch.is_tensor(value):
                    value.zero_()
    return created

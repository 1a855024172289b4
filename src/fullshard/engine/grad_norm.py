"""Gradient norm clipping across shards.

Each rank holds a disjoint slice of every sharded gradient, repeated on ``data_parallel_size /
shard_size`` ranks (replicas under HYBRID_SHARD, every rank under NO_SHARD). The global norm sums each
rank's ``|g|^p`` scaled by ``shard_size / world``, so that every distinct element counts exactly once;
parameters outside any unit (ignored ones) are held whole by every rank and are scaled by ``1 / world``.
A tensor parallel parameter split over ``T`` tp ranks (``TPSpec.num_shards``) is held by ``T`` times fewer
ranks, so it is scaled by ``shard_size * T / world`` (a tp-replicated one, such as a norm under
``SequenceParallel``, keeps ``T = 1``): the norm covers both mesh dimensions.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from fullshard.engine import invariant
from fullshard.engine.param import local_tensor
from fullshard.engine.unit_state import UnitState, unit_states_in

__all__ = ["clip_grad_norm_", "clip_module_grad_norm_"]


def clip_module_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of every parameter of ``module`` (its units' sharded parameters and any others it holds)
    to a global norm, as :func:`clip_grad_norm_`; return the norm before clipping."""
    states = unit_states_in(module)
    managed = {id(sp.sharded_param) for s in states if s.group for sp in s.group.params}
    others = [p for p in module.parameters() if id(p) not in managed]
    return clip_grad_norm_(states, others, max_norm, norm_type)


def clip_grad_norm_(
    states: list[UnitState], other_params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip the gradients of ``states``' sharded parameters and ``other_params`` to a global norm.

    Returns the total norm (before clipping) as a tensor, equal on every rank. Units in world-size-invariant mode
    sum a finite norm in a fixed order instead (``invariant.total_norm``); a maximum does not depend on the order.
    """
    norm_type = float(norm_type)
    if norm_type <= 0 and not math.isinf(norm_type):
        raise ValueError(f"clip_grad_norm_(norm_type={norm_type}) must be positive, or inf.")
    invariant_mode = any(s.config.invariant_micro_batches is not None for s in states)
    if invariant_mode:
        invariant.check_ready_to_clip(states)
    world = dist.get_world_size() if dist.is_initialized() else 1
    weighted: list[tuple[list[torch.Tensor], float]] = []
    for state in states:
        if state.group is None:
            continue
        shard_size = state.group.shard_group.shard_size
        by_tp: dict[int, list[torch.Tensor]] = {}  # tp shards -> gradients
        for sp in state.group.params:
            grad = sp.sharded_param.grad
            if grad is not None:
                by_tp.setdefault(1 if sp.tp is None else sp.tp.num_shards, []).append(local_tensor(grad))
        weighted.extend((grads, shard_size * tp / world) for tp, grads in by_tp.items())
    weighted.append(([local_tensor(p.grad) for p in other_params if p.grad is not None], 1.0 / world))
    all_grads = [g for grads, _ in weighted for g in grads]
    device = all_grads[0].device if all_grads else torch.device("cpu")
    if math.isinf(norm_type):
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in all_grads:
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().float())
        if world > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        total = local
    elif invariant_mode:
        total = invariant.total_norm(states, other_params, norm_type)
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
        for grads, weight in weighted:
            if grads:
                norms = torch._foreach_norm([g.detach() for g in grads], norm_type)
                local += weight * torch.stack([n.float() for n in norms]).pow(norm_type).sum()
        if world > 1:
            dist.all_reduce(local)
        total = local.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if all_grads:
        torch._foreach_mul_(all_grads, coef.to(all_grads[0].dtype))
    return total

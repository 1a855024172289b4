"""``summon_full_params``: full-precision copies of sharded parameters, for use outside forward/backward.

Inside the context every parameter of the summoned units is a full ``nn.Parameter`` in its original
dtype (never the compute dtype of mixed precision), registered where the sharded one was (a tensor parallel
parameter is full over the shard group: its tp ``DTensor``, as before sharding); on exit, with
``writeback``, each rank copies its rows of those tensors back into its shards, and the sharded parameters are
registered again. The gathered copies are separate from the training buffers. Tensor-subclass parameters (frozen
4-bit QLoRA weights, trainable ones; see ``extension.py``) are summoned whole as their ``fsdp_post_all_gather``
rebuilds them (their own class, or what the hook returns), requiring grad where they are trainable, as torch
FSDP2's ``unshard()`` shows them; they are never written back (the protocol has no way back to the shard, and a
gather may be lossy, as one in bf16) and get no ``with_grads`` gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from fullshard.engine.group import ParamGroup
from fullshard.engine.unit_state import TrainingState, UnitState, unit_state, unit_states_in
from fullshard.ranks import global_rank

__all__ = ["summon_full_params", "summoned_states"]


def summoned_states(module: nn.Module, recurse: bool) -> list[UnitState]:
    """The units ``summon_full_params(module, recurse=...)`` acts on."""
    states = unit_states_in(module)
    if recurse:
        return states
    own = unit_state(module)
    if own is not None:
        return [own]
    # Not a unit itself: the topmost units inside it.
    inner = {id(m) for s in states for m in s.module.modules() if m is not s.module}
    return [s for s in states if id(s.module) not in inner]


def _validate(states: list[UnitState], writeback: bool, rank0_only: bool) -> None:
    if writeback and rank0_only:
        raise ValueError(
            "summon_full_params(writeback=True, rank0_only=True) is not supported: other ranks would have "
            "nothing to write back. Pass writeback=False with rank0_only=True."
        )
    busy = [s.label for s in states if s.training_state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(
            f"summon_full_params was called during forward or backward (units {busy}); call it between "
            "iterations, after backward() has returned."
        )


def _summon_group(group: ParamGroup, show: bool, offload_to_cpu: bool, with_grads: bool) -> list[nn.Parameter]:
    group.reshard()
    fulls = group.gather_full()
    grads = group.gather_full(group.sharded_grad_flat()) if with_grads else None
    subclass = group.extension.full_copies() if group.extension is not None else []  # never written back
    if not show:
        return []
    for ep, full in zip(group.extension.params if group.extension is not None else [], subclass):
        ep.register(nn.Parameter(full.cpu() if offload_to_cpu else full, requires_grad=ep.training))
    summoned = []
    for i, sp in enumerate(group.params):
        # A tensor parallel parameter is summoned as what its module computes with: its tp DTensor.
        full = sp.compute_view(fulls[i].cpu() if offload_to_cpu else fulls[i])
        param = nn.Parameter(full, requires_grad=sp.requires_grad)
        if grads is not None and sp.sharded_param.grad is not None:
            param.grad = sp.compute_view(grads[i].cpu() if offload_to_cpu else grads[i])
        sp.register(param)
        summoned.append(param)
    group.set_summoned(True)
    return summoned


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Gather full parameters of ``module``'s units for the duration of the block; see the module docstring."""
    states = [s for s in summoned_states(module, recurse) if s.group is not None]
    _validate(states, writeback, rank0_only)
    show = not rank0_only or global_rank() == 0
    summoned: list[tuple[ParamGroup, list[nn.Parameter]]] = []
    try:
        for group in [s.group for s in states if s.group is not None]:  # all of them; repeated for the types
            summoned.append((group, _summon_group(group, show, offload_to_cpu, with_grads)))
        yield
    finally:
        for group, params in summoned:
            if writeback and params:
                with torch.no_grad():
                    group.write_back([p.detach().to(group.device) for p in params])
            for sp in group.params:
                sp.register_sharded()
            if group.extension is not None:
                group.extension.register_sharded()
            group.set_summoned(False)

"""Parameters assigned after sharding, taken back into their unit's shards.

torch's FSDP2 lets a user replace a sharded parameter before the first forward (``module.w = nn.Parameter(full)``),
re-read at lazy init. Here the unit state's lazy init calls :func:`adopt_replaced_params` on every group, which ends
in :meth:`ParamGroup.adopt_applied_params`, as ``_apply`` does; so does ``FSDPModule.unshard()`` on a sharded unit
(it may run before the first forward). (``load_state_dict(assign=True)`` onto a model sharded on ``meta`` is the state
dict pre-hook's: ``state_dict._materialize_for``.)

torch's ``replicate()`` (DDP) applied over a unit replaces its sharded parameters with DDP's local copies of their
shards (marked ``_st_info``, torch's DDP + tensor-parallel helper) and broadcasts rank 0's over the others': torch
leaves its own units alone through a private registry fullshard cannot join, so such a copy is refused here.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.engine.group import ParamGroup, ShardState
from fullshard.engine.param import ShardedParam, local_tensor

__all__ = ["adopt_replaced_params"]


def adopt_replaced_params(group: ParamGroup) -> None:
    """Take in parameters the user assigned after sharding (``module.weight = nn.Parameter(...)`` or
    ``load_state_dict(assign=True)`` before the first forward, as torch's FSDP2 does at lazy init): a full tensor
    of the parameter's shape gives this rank's rows, a ``DTensor`` laid out as the sharded parameter its local
    tensor; the values then move into ``flat_shard`` (:meth:`ParamGroup.adopt_applied_params`)."""
    replaced = False
    for sp in group.params:
        module, name = sp.registrations[0]
        current = module._parameters[name]
        if current is sp.sharded_param or current is None or group.state is not ShardState.SHARDED:
            continue
        if getattr(current, "_st_info", None) is not None:
            raise ValueError(
                f"unit {group.label!r}: parameter {sp.fqn!r} was replaced by DDP's local copy of its shard: torch's "
                "replicate() (or DistributedDataParallel) was applied over a module under fullshard's fully_shard, "
                "and it has already broadcast rank 0's shards over the other ranks'. Apply replicate()/DDP only to "
                "modules outside fully_shard's units (or use fully_shard on a 2-D (replicate, shard) mesh for HSDP), "
                "and rebuild the model."
            )
        if isinstance(current, DTensor):
            if tuple(current.placements) != group.placements_of(sp) or tuple(current.shape) != sp.shape:
                current = current.full_tensor()
            else:
                local = current.to_local().detach()
        if not isinstance(current, DTensor):
            if tuple(current.shape) != sp.shape:
                raise ValueError(
                    f"unit {group.label!r}: parameter {sp.fqn!r} was replaced after sharding by a tensor of shape "
                    f"{tuple(current.shape)}, but it has shape {sp.shape}. Assign a tensor of the parameter's full "
                    "shape (or a DTensor laid out as the sharded parameter), or replace it before fully_shard."
                )
            local = sp.rows_of(local_tensor(current).detach())
        param = nn.Parameter(_sharded(group, sp, local), requires_grad=sp.requires_grad)
        sp.sharded_param = param
        sp.register_sharded()
        replaced = True
    if replaced:
        group.adopt_applied_params()


def _sharded(group: ParamGroup, sp: ShardedParam, local: torch.Tensor) -> torch.Tensor:
    return group.dtensor_of(sp, local) if group.use_dtensor else local

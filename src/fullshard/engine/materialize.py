"""Units built on the ``meta`` device: where their shards live, and taking them back after ``_apply``.

``fully_shard`` on a module built under ``torch.device("meta")`` (without ``param_init_fn`` or
``sync_module_states``) leaves it there, as torch's ``fully_shard`` does: the unit's ``flat_shard`` is a meta
tensor and its sharded parameters are ``DTensor``s of meta local shards, so sharding allocates nothing.
The user then gives the model storage with ``model.to_empty(device=...)`` and initialises it in place
(``reset_parameters()`` per module, or a torchtitan-style ``init_weights``), on the sharded parameters.

``to_empty`` goes through ``nn.Module._apply``, which hands each sharded parameter new local storage (in
place: ``torch.utils.swap_tensors`` for ``DTensor``s, ``.data`` for plain parameters). The unit's
``_apply`` override then calls :func:`adopt_applied_params`, which allocates a real ``flat_shard`` and makes
the parameters views of it again (see [Note: group buffers] in ``group.py``), so the values the user writes
into them are what the next all-gather reads. Torch's FSDP2 re-reads its sharded parameters the same way
after ``_apply``.

This module imports only torch and ``param.py``; ``group.py`` imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fullshard.engine.param import local_tensor, set_owner

if TYPE_CHECKING:
    from fullshard.engine.group import Offload, ParamGroup

__all__ = ["adopt_applied_params", "meta_parameter_names", "storage_device_for"]


def storage_device_for(
    label: str, named: list[tuple[str, nn.Parameter]], device: torch.device, offload: Offload | None
) -> torch.device:
    """Where a unit's shards live: ``meta`` when its parameters are (nothing is allocated until ``to_empty``),
    the CPU when offloading, else the compute device ``device``."""
    on_meta = {p.is_meta for _, p in named}
    if on_meta == {True}:
        return torch.device("meta")
    if len(on_meta) > 1:
        names = [name for name, p in named if p.is_meta][:5]
        raise ValueError(
            f"unit {label!r} has parameters on the meta device ({names}) and others with storage; a unit's "
            "parameters must all be on meta (materialized later with to_empty) or all real. Build the whole "
            "module under torch.device('meta'), or initialise it fully before sharding."
        )
    return torch.device("cpu") if offload is not None else device


def adopt_applied_params(group: ParamGroup) -> None:
    """Make ``group``'s sharded parameters views of its ``flat_shard`` again after ``nn.Module._apply``.

    Nothing to do while they stay on ``meta`` or still share ``flat_shard``'s storage (``.to`` to where they
    already are). Otherwise a new ``flat_shard`` is allocated on their (single) device and their values are
    copied in. Precondition: the group is sharded (the caller reshards first).
    """
    for sp in group.params:
        module, name = sp.registrations[0]
        current = module._parameters[name]
        if current is not sp.sharded_param:  # replaced (overwrite_module_params_on_conversion), not changed in place
            sp.sharded_param = current
            sp.register_sharded()
    locals_ = [local_tensor(sp.sharded_param).detach() for sp in group.params]  # type: ignore[arg-type]
    storage = group.flat_shard.untyped_storage()
    if all(t.is_meta for t in locals_) or all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in locals_):
        return
    devices = {t.device for t in locals_}
    dtypes = {t.dtype for t in locals_}
    if len(devices) != 1 or dtypes != {group.dtype}:
        raise ValueError(
            f"unit {group.label!r}: after moving the module its sharded parameters are on {sorted(map(str, devices))} "
            f"with dtypes {sorted(map(str, dtypes))}, but a unit keeps its parameters in {group.dtype} on one device. "
            "Move the whole model at once (model.to_empty(device=...) or model.to(device)), and cast dtypes before "
            "sharding."
        )
    group.new_shard_storage(devices.pop())
    with torch.no_grad():
        for sp, local in zip(group.params, locals_):
            view = sp.local_view(group.flat_shard)
            view.copy_(local)
            if group.use_dtensor:
                sp.sharded_param._local_tensor = view  # type: ignore[union-attr]
            else:
                sp.sharded_param.data = view  # type: ignore[union-attr]
            set_owner(sp.sharded_param, group.label)  # type: ignore[arg-type]


def meta_parameter_names(group: ParamGroup) -> list[str]:
    """The names of ``group``'s parameters that still have no storage."""
    return [sp.fqn for sp in group.params if sp.sharded_param is not None and sp.sharded_param.is_meta]

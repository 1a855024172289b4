"""GroupMoves: where a unit's shards live changes after sharding: moved or cast by ``nn.Module._apply``
(``model.to(device)``, ``model.to(dtype)``, ``to_empty``), or given storage from ``meta``.

``ParamGroup`` (``group.py``) mixes in :class:`GroupMoves`. Invariants: afterwards each sharded parameter (the
same object the optimizer holds) is again a view of this rank's rows in ``flat_shard``, on one device, in the
group's dtype (a unit of mixed dtypes: each parameter in its own, never cast); a cast moves the group's
precision with it, as torch's ``fully_shard`` does. Preconditions: the group is sharded (``new_shard_storage``
checks it; ``materialize`` reshards first). The class reads, and does not set up, the group's ``params``,
``flat_shard``, ``dtype``, ``mixed``, ``offload``, ``world``, ``use_dtensor`` and ``label``, and calls its
``new_shard_storage``, ``reshard`` and ``dtensor_of``.
"""

from __future__ import annotations

import torch
from torch import nn

from fullshard.engine.param import local_tensor, set_owner
from fullshard.engine.precision import Casts, group_precision

__all__ = ["GroupMoves"]


class GroupMoves:
    """A ``ParamGroup``'s shards moved, cast or materialized; see the module docstring."""

    @property
    def is_meta(self) -> bool:
        """The shards have no storage yet (built under ``torch.device("meta")``; see ``materialize.py``)."""
        return self.flat_shard.is_meta

    def adopt_applied_params(self, casts: Casts | None = None) -> None:
        """Make the sharded parameters views of ``flat_shard`` again after ``nn.Module._apply``.

        Nothing to do while they stay on ``meta`` or still share ``flat_shard``'s storage (``.to`` to where they
        already are). Otherwise a new ``flat_shard`` is allocated on their (single) device and their values are
        copied in. Precondition: the group is sharded (the caller reshards first).
        """
        for sp in self.params:
            module, name = sp.registrations[0]
            current = module._parameters[name]
            # replaced (overwrite_module_params_on_conversion), not changed in place
            if current is not sp.sharded_param:
                sp.sharded_param = current
                sp.register_sharded()
        locals_ = [local_tensor(sp.sharded_param).detach() for sp in self.params]  # type: ignore[arg-type]
        storage = self.flat_shard.untyped_storage()
        devices = {t.device for t in locals_}
        dtypes = {t.dtype for t in locals_}
        cast = (
            len(dtypes) == 1
            and dtypes != {self.dtype}
            and casts is not None
            and next(iter(dtypes)).is_floating_point
            and not self.mixed
        )
        if not cast and all(t.is_meta for t in locals_):
            return
        if not cast and all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in locals_):
            return
        if self.mixed and any(t.dtype != sp.dtype for t, sp in zip(locals_, self.params)):
            raise ValueError(
                f"unit {self.label!r} holds parameters of several dtypes and cannot be cast after sharding (now "
                f"{sorted(map(str, dtypes))}). Cast the model before sharding it."
            )
        if len(devices) != 1 or (dtypes != {self.dtype} and not cast and not self.mixed):
            raise ValueError(
                f"unit {self.label!r}: after moving the module its sharded parameters are on "
                f"{sorted(map(str, devices))} with dtypes {sorted(map(str, dtypes))}, but a unit keeps its parameters "
                f"in one floating-point dtype on one device (now {self.dtype}). "
                "Move and cast the whole model at once (model.to_empty(device=...), model.to(device), "
                "model.to(torch.bfloat16))."
            )
        if cast:  # model.to(dtype): the unit's shards, gathers and gradients follow (as torch's fully_shard)
            self.dtype = dtypes.pop()
            self.precision = group_precision(casts, self.dtype)  # type: ignore[arg-type]
            self.alias_full = self.world == 1 and self.precision.param_dtype == self.dtype and self.offload is None
        self.new_shard_storage(devices.pop())
        with torch.no_grad():
            for sp, local in zip(self.params, locals_):
                sp.local_view(self.flat_shard).copy_(local)
        self._rebind_sharded_params()

    def materialize(self, device: torch.device) -> None:
        """Give a unit built on ``meta`` zero storage on ``device``; its sharded parameters become views of it (for
        ``load_state_dict(..., assign=True)`` onto a model sharded on ``meta``, which then fills it)."""
        self.reshard()
        self.new_shard_storage(device)
        if not self.use_dtensor:
            self._rebind_sharded_params()
            return
        for sp in self.params:  # a DTensor's own device is fixed: swap in one on ``device``, keeping the object
            param = sp.sharded_param
            real = nn.Parameter(self.dtensor_of(sp, sp.local_view(self.flat_shard)), param.requires_grad)  # type: ignore[union-attr]
            torch.utils.swap_tensors(param, real)
            set_owner(param, self.label)  # type: ignore[arg-type]

    def _rebind_sharded_params(self) -> None:
        """Make each sharded parameter (the same object) a view of this rank's rows in ``flat_shard`` again."""
        for sp in self.params:
            view = sp.local_view(self.flat_shard)
            if self.use_dtensor:
                sp.sharded_param._local_tensor = view  # type: ignore[union-attr]
            else:
                sp.sharded_param.data = view  # type: ignore[union-attr]
            set_owner(sp.sharded_param, self.label)  # type: ignore[arg-type]

    def meta_parameter_names(self) -> list[str]:
        """The names of the parameters that still have no storage."""
        return [sp.fqn for sp in self.params if sp.sharded_param is not None and sp.sharded_param.is_meta]

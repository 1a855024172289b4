"""The guard that makes a direct call of a module inside a unit fail clearly while the unit is sharded.

``guard_direct_calls`` registers, on each module of a unit below its root module, a forward pre-hook
(``_DirectCallGuard``) that lets the call through only while the unit's parameters are gathered, registered as
full views, summoned, or are the whole parameters at rest (``alias_full``, plain tensors). A pickled or deep-copied
module carries a ``_CopiedGuard`` instead, which remembers whether the copy held whole parameters. The guards read
the group's ``alias_full``, ``use_dtensor``, ``full_views_registered`` and ``summoned`` at each call, and change
nothing.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from fullshard.engine.group import ParamGroup

__all__ = ["guard_direct_calls"]


def guard_direct_calls(
    unit_label: str, group: ParamGroup, modules: list[tuple[str, nn.Module]]
) -> list[RemovableHandle]:
    """Make a forward of ``modules`` (inside the unit) fail clearly unless the unit's parameters are gathered.

    Where the shards are the whole parameters at rest (one rank holds all of them, in the compute dtype, on the
    device, as plain tensors: ``alias_full`` of an FSDP wrapper's unit), a direct call computes with the right
    values and is let through, as torch's FSDP1 runs one rank as ``NO_SHARD`` (e.g. a module unwrapped from a
    one-process wrapper). A pickled (or deep-copied) module keeps a guard that knows whether it held the whole
    parameters when it was copied."""
    return [module.register_forward_pre_hook(_DirectCallGuard(unit_label, group, fqn)) for fqn, module in modules]


def _direct_call_error(module: nn.Module, fqn: str, unit_label: str) -> RuntimeError:
    return RuntimeError(
        f"{type(module).__name__} at {fqn!r} was called directly, but its parameters belong to the sharded unit "
        f"{unit_label!r} and are sharded right now, so it would compute with one rank's slice of each weight. Call "
        f"the unit's forward instead, wrap {fqn!r} as a unit of its own, or call it inside "
        "FullyShardedDataParallel.summon_full_params(model)."
    )


class _DirectCallGuard:
    """The forward pre-hook of :func:`guard_direct_calls` for one module."""

    def __init__(self, unit_label: str, group: ParamGroup, fqn: str) -> None:
        self.unit_label, self.group, self.fqn = unit_label, group, fqn

    def _whole(self) -> bool:
        group = self.group
        return group.alias_full and not group.use_dtensor  # model.to(dtype) may change alias_full: asked each call

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not self._whole() and not self.group.full_views_registered and not self.group.summoned:
            raise _direct_call_error(module, self.fqn, self.unit_label)

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy holds tensors, not the unit: it computes right only if they were the whole parameters.
        whole = self._whole() or self.group.full_views_registered or self.group.summoned
        return (_CopiedGuard, (self.unit_label, self.fqn, whole))


class _CopiedGuard:
    """A :class:`_DirectCallGuard` in a copied module: passes if the copy holds whole parameters, else refuses."""

    def __init__(self, unit_label: str, fqn: str, whole: bool) -> None:
        self.unit_label, self.fqn, self.whole = unit_label, fqn, whole

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not self.whole:
            raise _direct_call_error(module, self.fqn, self.unit_label)

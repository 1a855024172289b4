"""A sharding plan: how to shard one model, resolved once, then applied in one trip down the engine.

A front end (the Accelerate-style plugin) resolves its settings into a :class:`ShardingPlan` with
:func:`plan_sharding`: the auto-wrap policy is applied to the model once (the blocks that become units, innermost
first), the ignored modules are found once, and precision, offload and initialisation are fixed. :func:`apply_plan`
then shards the model by the plan alone: activation checkpointing of the policy's blocks (``checkpointing.py``),
then nested ``FullyShardedDataParallel`` wrappers and the root wrapper (``version=1``), or ``fully_shard`` on each
block and the root (``version=2``). Nothing in the plan is looked up again, and nothing calls back into the front
end. Built on the engine's public entry points only, so it lives beside the engine, not in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fullshard.algorithms.checkpointing import checkpoint_module
from fullshard.engine import (
    FULL_PRECISION_OUTPUT,
    FSDPModule,
    FullyShardedDataParallel,
    InitOptions,
    MixedPrecision,
    MixedPrecisionPolicy,
    UnitPlan,
    fully_shard,
    is_unit,
    plan_units,
    plan_wrapper_units,
    wrap_units,
)

__all__ = ["ShardingPlan", "apply_plan", "plan_sharding"]


@dataclass(frozen=True)
class ShardingPlan:
    """Everything :func:`apply_plan` needs to shard one model; built by :func:`plan_sharding`.

    ``units`` are the submodules that become units of their own, innermost first (the root is always one);
    ``checkpointed`` the blocks whose activations are recomputed in backward (the policy's own picks).
    ``options`` are the remaining keyword arguments of the entry point: ``FullyShardedDataParallel``'s
    (strategy, prefetch, ``limit_all_gathers``, ``use_orig_params``, ``device_id``) for ``version=1``,
    ``fully_shard``'s ``reshard_after_forward`` for ``version=2``.
    """

    version: int
    units: tuple[UnitPlan, ...]
    ignored_modules: tuple[nn.Module, ...]
    precision: MixedPrecision | MixedPrecisionPolicy | None
    offload: Any
    init: InitOptions
    checkpointed: tuple[nn.Module, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)


def plan_sharding(
    model: nn.Module,
    *,
    version: int,
    auto_wrap_policy: Callable[..., Any] | None,
    ignored_modules: list[nn.Module],
    precision: MixedPrecision | MixedPrecisionPolicy | None,
    offload: Any,
    init: InitOptions,
    activation_checkpointing: bool = False,
    **options: Any,
) -> ShardingPlan:
    """Apply ``auto_wrap_policy`` to ``model`` once and fix every other setting; see the module docstring."""
    if version == 1:
        mixed = precision if isinstance(precision, MixedPrecision) else None
        units = plan_wrapper_units(model, auto_wrap_policy, mixed, ignored_modules)
    else:
        units = plan_units(model, auto_wrap_policy, ignored_modules=ignored_modules, is_unit=is_unit)
    blocks = tuple(u.module for u in units if FULL_PRECISION_OUTPUT not in u.overrides)
    return ShardingPlan(
        version=version,
        units=tuple(units),
        ignored_modules=tuple(ignored_modules),
        precision=precision,
        offload=offload,
        init=init,
        checkpointed=blocks if activation_checkpointing else (),
        options=dict(options),
    )


def apply_plan(model: nn.Module, plan: ShardingPlan) -> nn.Module:
    """Shard ``model`` as ``plan`` says; returns the sharded model (the root wrapper for ``version=1``,
    ``model`` itself, changed in place, for ``version=2``)."""
    for block in plan.checkpointed:
        checkpoint_module(block)
    if plan.version == 2:
        ignored_params = {p for m in plan.ignored_modules for p in m.parameters()}
        kwargs: dict[str, Any] = {
            "mp_policy": plan.precision or MixedPrecisionPolicy(),
            "offload_policy": plan.offload,
            "param_init_fn": plan.init.param_init_fn,
            "sync_module_states": plan.init.sync_module_states,
            **({"ignored_params": ignored_params} if ignored_params else {}),
            **plan.options,
        }
        for unit in [*(u.module for u in plan.units), model]:
            if not isinstance(unit, FSDPModule):
                fully_shard(unit, **kwargs)
        return model
    kwargs = {
        "cpu_offload": plan.offload,
        "mixed_precision": plan.precision,
        "ignored_modules": list(plan.ignored_modules) or None,
        "param_init_fn": plan.init.param_init_fn,
        "sync_module_states": plan.init.sync_module_states,
        **plan.options,
    }
    wrap_units(model, list(plan.units), kwargs)
    return FullyShardedDataParallel(model, **kwargs)

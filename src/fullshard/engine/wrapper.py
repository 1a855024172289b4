"""``FullyShardedDataParallel``: the module wrapper with the constructor of torch's FSDP (seed 004).

The wrapper is a thin shell over the engine: it resolves its arguments once (strategy → reshard and
process groups, prefetch, wrap policy), creates nested wrappers for the submodules the policy picks, and
builds one unit for what remains. Parameters stay registered on the original modules under their
original names; ``named_parameters()`` and ``named_buffers()`` drop the ``_fsdp_wrapped_module.`` prefix.
``use_orig_params`` and ``limit_all_gathers`` are accepted for compatibility: the engine always exposes the
original parameters, and never gathers more than the current unit and one prefetched unit ahead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fullshard.engine import grad_norm, summon
from fullshard.engine.api import BackwardPrefetch, MixedPrecision, ShardingStrategy
from fullshard.engine.coerce import coerce_enum, coerce_optional_enum
from fullshard.engine.mesh import build_shard_group, require_process_group
from fullshard.engine.state import UnitConfig, UnitState, set_gradient_sync, unit_state, unit_states_in
from fullshard.engine.unit import WRAPPED_NAME, build_unit, resolve_device, resolve_ignored
from fullshard.engine.wrap import plan_units

__all__ = ["FullyShardedDataParallel"]

_RESHARD_AFTER_FORWARD = {
    ShardingStrategy.FULL_SHARD: True,
    ShardingStrategy.HYBRID_SHARD: True,
    ShardingStrategy.SHARD_GRAD_OP: False,
    ShardingStrategy._HYBRID_SHARD_ZERO2: False,
    ShardingStrategy.NO_SHARD: False,
}


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters, gradients and optimizer states across data-parallel ranks.

    Create the optimizer after wrapping, from ``wrapped.parameters()``.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
        sharding_strategy: ShardingStrategy | str | None = None,
        cpu_offload: Any = None,
        auto_wrap_policy: Callable[..., Any] | None = None,
        backward_prefetch: BackwardPrefetch | str | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[Any] | None = None,
        device_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel(module=...) takes an nn.Module, got {type(module).__name__}.")
        strategy = coerce_enum(
            ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy,
            ShardingStrategy,
            arg="sharding_strategy",
            allow_int=True,
        )
        prefetch = coerce_optional_enum(backward_prefetch, BackwardPrefetch, arg="backward_prefetch", allow_int=True)
        require_process_group("FullyShardedDataParallel")
        ignored = resolve_ignored(module, ignored_modules, ignored_states)
        device = resolve_device(device_id, module)
        child_kwargs = {
            "process_group": process_group,
            "sharding_strategy": strategy,
            "cpu_offload": cpu_offload,
            "backward_prefetch": prefetch,
            "mixed_precision": mixed_precision,
            "param_init_fn": param_init_fn,
            "device_id": device_id,
            "sync_module_states": sync_module_states,
            "forward_prefetch": forward_prefetch,
            "limit_all_gathers": limit_all_gathers,
            "use_orig_params": use_orig_params,
            "ignored_states": list(ignored_modules or []) + list(ignored_states or []) or None,
            "device_mesh": device_mesh,
        }
        _wrap_children(module, auto_wrap_policy, child_kwargs, ignored_modules or ignored_states or ())
        self._fsdp_wrapped_module = module
        shard_group = build_shard_group(strategy, process_group, device_mesh, device)
        config = UnitConfig(
            reshard_after_forward=_RESHARD_AFTER_FORWARD[strategy],
            backward_prefetch=prefetch,
            forward_prefetch=bool(forward_prefetch),
        )
        self.sharding_strategy = strategy
        self._unit = build_unit(self, shard_group, config, ignored=ignored, label=type(module).__name__)

    # --- module plumbing ----------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._unit.pre_forward()
        output = self._fsdp_wrapped_module(*args, **kwargs)
        return self._unit.post_forward(output)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        for name, param in super().named_parameters(*args, **kwargs):
            yield _clean_name(name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, buf in super().named_buffers(*args, **kwargs):
            yield _clean_name(name), buf

    # --- FSDP methods -------------------------------------------------------------------------------

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """The FullyShardedDataParallel instances in ``module``'s tree (only the outermost if ``root_only``)."""
        found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return found
        inner = {id(m) for f in found for m in f.modules() if m is not f}
        return [f for f in found if id(f) not in inner]

    @staticmethod
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> contextlib.AbstractContextManager[None]:
        """Gather the full parameters for the block (see ``fullshard.engine.summon``)."""
        return summon.summon_full_params(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads)

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:  # type: ignore[override]
        """Apply ``fn`` to every submodule, with this unit's full parameters gathered and written back."""
        with summon.summon_full_params(self, recurse=False, writeback=True):
            super().apply(fn)
        return self

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (unsharded) without reducing them; the next backward outside syncs."""
        states = unit_states_in(self)
        previous = set_gradient_sync(states, False)
        try:
            yield
        finally:
            for state, value in zip(states, previous):
                state.requires_gradient_sync = value

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients of this (root) module to a global norm; return the norm before clipping."""
        state = self._unit
        if state.ctx is not None and not state.is_root:
            raise RuntimeError("clip_grad_norm_ must be called on the root FullyShardedDataParallel module.")
        states = unit_states_in(self)
        managed = {id(sp.sharded_param) for s in states if s.group for sp in s.group.params}
        others = [p for p in self.parameters() if id(p) not in managed]
        return grad_norm.clip_grad_norm_(states, others, max_norm, norm_type)

    @property
    def unit_state(self) -> UnitState:
        return self._unit


FSDP = FullyShardedDataParallel


def _clean_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part != WRAPPED_NAME)


def _wrap_children(
    module: nn.Module, policy: Callable[..., Any] | None, kwargs: dict[str, Any], ignored: Iterable[Any]
) -> None:
    """Replace each submodule that ``policy`` selects with a nested FullyShardedDataParallel, innermost first."""
    ignored_modules = [m for m in ignored if isinstance(m, nn.Module)]
    plans = plan_units(module, policy, ignored_modules=ignored_modules, is_unit=lambda m: unit_state(m) is not None)
    if not plans:
        return
    parents = {id(child): (parent, name) for parent in module.modules() for name, child in parent.named_children()}
    for plan in plans:
        parent, name = parents[id(plan.module)]
        overrides = dict(plan.overrides)
        setattr(parent, name, FullyShardedDataParallel(plan.module, **{**kwargs, **overrides}))

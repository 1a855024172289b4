"""``FullyShardedDataParallel``: the module wrapper with the constructor of torch's FSDP.

The wrapper is a thin shell over the engine: it resolves its arguments once (strategy → reshard and
process groups, prefetch, wrap policy), creates nested wrappers for the submodules the policy picks, and
builds one unit for what remains. Parameters stay registered on the original modules under their
original names; ``named_parameters()`` and ``named_buffers()`` drop the ``_fsdp_wrapped_module.`` prefix.
``named_modules()`` keeps torch's names at the top of the call (``_fsdp_wrapped_module`` and what is below it),
but a wrapper reached from a parent drops its own segment, so a module's names show at most the leading segment
of the wrapper the call started at: the names of the user's model, which PEFT (that strips only a leading
``_fsdp_wrapped_module.``) matches against state-dict keys when it saves an adapter.
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
from torch.distributed.tensor import DTensor

from fullshard.engine import grad_norm, invariant, optim_state, summon
from fullshard.engine import state_dict as sd
from fullshard.engine.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    Offload,
    ShardingStrategy,
    StateDictType,
)
from fullshard.engine.coerce import coerce_enum, coerce_optional_enum
from fullshard.engine.mesh import build_shard_group, require_process_group
from fullshard.engine.names import WRAPPED_NAME, clean_key
from fullshard.engine.param import owner_label
from fullshard.engine.precision import cast_floating, casts_from_mixed_precision
from fullshard.engine.unit import Ignored, InitOptions, build_unit, resolve_device, resolve_ignored
from fullshard.engine.unit_state import UnitConfig, UnitState, gradient_sync, is_unit, unit_states_in
from fullshard.engine.wrap import UnitPlan, plan_units

__all__ = ["FullyShardedDataParallel"]

_RESHARD_AFTER_FORWARD = {
    ShardingStrategy.FULL_SHARD: True,
    ShardingStrategy.HYBRID_SHARD: True,
    ShardingStrategy.SHARD_GRAD_OP: False,
    ShardingStrategy._HYBRID_SHARD_ZERO2: False,
    ShardingStrategy.NO_SHARD: False,
}


def _refuse_tensor_parallel(module: nn.Module, ignored: Ignored) -> None:
    """Refuse tensor parallel (``DTensor``) parameters before anything is wrapped: only ``fully_shard`` takes them."""
    for name, param in module.named_parameters():
        if isinstance(param, DTensor) and owner_label(param) is None and id(param) not in ignored.param_ids:
            raise ValueError(
                f"FullyShardedDataParallel(module=...): parameter {name!r} is a DTensor over mesh "
                f"{param.device_mesh.mesh_dim_names or param.device_mesh.shape} with placements {param.placements} "
                "(tensor parallelism, e.g. parallelize_module). The FullyShardedDataParallel class shards plain "
                "tensors only; combine tensor parallelism with fully_shard: fully_shard(block, mesh=mesh['dp']) "
                "for each block, then fully_shard(model, mesh=mesh['dp'])."
            )


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
        invariant_micro_batches: int | None = None,
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
        micro_batches = invariant.resolve(invariant_micro_batches, "FullyShardedDataParallel")
        ignored = resolve_ignored(module, ignored_modules, ignored_states)
        _refuse_tensor_parallel(module, ignored)
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
            "invariant_micro_batches": micro_batches,
        }
        casts = casts_from_mixed_precision(mixed_precision)
        offload = _resolve_offload(cpu_offload)
        ignored_given = [m for m in [*(ignored_modules or ()), *(ignored_states or ())] if isinstance(m, nn.Module)]
        wrap_units(module, plan_wrapper_units(module, auto_wrap_policy, mixed_precision, ignored_given), child_kwargs)
        self._fsdp_wrapped_module = module
        shard_group = build_shard_group(strategy, process_group, device_mesh, device)
        config = UnitConfig(
            reshard_after_forward=_RESHARD_AFTER_FORWARD[strategy],
            backward_prefetch=prefetch,
            forward_prefetch=bool(forward_prefetch),
            limit_all_gathers=bool(limit_all_gathers),
            casts=casts,
            expose_unsynced_grads=True,
            invariant_micro_batches=micro_batches,
        )
        self.sharding_strategy = strategy
        self.mixed_precision = mixed_precision
        self.cpu_offload = cpu_offload if cpu_offload is not None else CPUOffload()
        init = InitOptions(param_init_fn=param_init_fn, sync_module_states=bool(sync_module_states))
        self._unit = build_unit(
            self, shard_group, config, ignored=ignored, label=type(module).__name__, offload=offload, init=init
        )
        if micro_batches is not None and self._unit.group is not None:
            where = f"FullyShardedDataParallel({type(module).__name__})"
            invariant.validate_group(self._unit.group, micro_batches, where)
        sd.install_state_dict_hooks(
            self,
            self._unit,
            default_type=StateDictType.FULL_STATE_DICT,
            segment=WRAPPED_NAME + ".",
            where=f"FullyShardedDataParallel({type(module).__name__})",
        )

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

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``nn.Module._apply`` (``.to``, ``.cuda``, ``.double()``), then take the moved or cast parameters back into
        the unit's flat shard: left outside it, the optimizer would step tensors that no gather reads."""
        unit: UnitState | None = self.__dict__.get("_unit")
        group = None if unit is None else unit.group
        if group is not None:
            group.reshard()
        result = super()._apply(fn, recurse)
        if group is not None:
            group.adopt_applied_params(unit.config.casts)  # type: ignore[union-attr]
        return result

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._unit.pre_forward(args, kwargs)
        output = self._fsdp_wrapped_module(*args, **kwargs)
        return self._unit.post_forward(output)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        for name, param in super().named_parameters(*args, **kwargs):
            yield clean_key(name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, buf in super().named_buffers(*args, **kwargs):
            yield clean_key(name), buf

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        """torch's names when called on this wrapper; reached from a parent (``prefix`` set), the wrapped module
        and everything below it are named without this wrapper's segment (see the module docstring)."""
        names = super().named_modules(memo, prefix, remove_duplicate)
        if not prefix:
            yield from names
            return
        own = f"{prefix}.{WRAPPED_NAME}"
        for name, module in names:
            yield (prefix + name[len(own) :] if name == own or name.startswith(own + ".") else name), module

    # --- FSDP methods -------------------------------------------------------------------------------

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """The FullyShardedDataParallel instances in ``module``'s tree (only the outermost if ``root_only``)."""
        found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return found
        inner = {id(m) for f in found for m in f.modules() if m is not f}
        return [f for f in found if id(f) not in inner]

    summon_full_params = staticmethod(summon.summon_full_params)

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:  # type: ignore[override]
        """Apply ``fn`` to every submodule, with this unit's full parameters gathered and written back."""
        with summon.summon_full_params(self, recurse=False, writeback=True):
            super().apply(fn)
        return self

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (unsharded) without reducing them; the next backward outside syncs."""
        return gradient_sync(self, False)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients of this (root) module to a global norm; return the norm before clipping."""
        state = self._unit
        if state.ctx is not None and not state.is_root:
            raise RuntimeError("clip_grad_norm_ must be called on the root FullyShardedDataParallel module.")
        return grad_norm.clip_module_grad_norm_(self, max_norm, norm_type)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Reduce gradients with ``hook`` instead of the built-in reduce-scatter / all-reduce, in every unit.

        Sharded strategies call ``hook(state, grad, output)``: ``grad`` is the flat unsharded gradient (all
        ranks' chunks, rank-major) and the hook must write this rank's reduced, averaged chunk into
        ``output``. NO_SHARD calls ``hook(state, grad)``, to all-reduce and average ``grad`` in place.
        Register on the root, before the first forward, once.
        """
        self._unit_comm_hook_checks()
        for unit in unit_states_in(self):
            if unit.group is not None:
                unit.group.set_comm_hook(state, hook)

    def _unit_comm_hook_checks(self) -> None:
        if FullyShardedDataParallel.fsdp_modules(self, root_only=True) != [self] or (
            self._unit.ctx is not None and not self._unit.is_root
        ):
            raise RuntimeError("register_comm_hook must be called on the root FullyShardedDataParallel module.")
        if self.sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
            raise ValueError(
                f"register_comm_hook with sharding_strategy={self.sharding_strategy.name}: communication hooks "
                "cover one reduction, and hybrid sharding needs two (within and across shard groups). Use "
                "FULL_SHARD, SHARD_GRAD_OP or NO_SHARD with a hook, or no hook."
            )
        for unit in unit_states_in(self):
            if unit.group is not None and unit.group.comm_hook is not None:
                raise RuntimeError("a communication hook is already registered on this model; register it once.")
            if unit.ran_forward or unit.ctx is not None:
                raise RuntimeError("register_comm_hook must be called before the first forward.")

    # --- state dicts (see fullshard.engine.state_dict and fullshard.engine.optim_state) --------------

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load full tensors or DTensors under the unwrapped model's keys; checked before anything is copied."""
        return sd.load_checked(self, state_dict, strict, assign, super().load_state_dict)

    # Same signatures as torch's FSDP methods; the engine's functions are the methods.
    set_state_dict_type = staticmethod(sd.set_state_dict_type)
    get_state_dict_type = staticmethod(sd.get_state_dict_type)
    state_dict_type = staticmethod(sd.state_dict_type)
    optim_state_dict = staticmethod(optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(optim_state.optim_state_dict_to_load)
    full_optim_state_dict = staticmethod(optim_state.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(optim_state.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(optim_state.shard_full_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(optim_state.scatter_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(optim_state.flatten_sharded_optim_state_dict)
    rekey_optim_state_dict = staticmethod(optim_state.rekey_optim_state_dict)


FSDP = FullyShardedDataParallel


def _resolve_offload(cpu_offload: Any) -> Offload | None:
    if cpu_offload is None:
        return None
    if not hasattr(cpu_offload, "offload_params"):
        raise TypeError(
            f"FullyShardedDataParallel(cpu_offload={cpu_offload!r}): pass CPUOffload(offload_params=True) to keep "
            "sharded parameters and gradients on the CPU, or CPUOffload() / None not to."
        )
    return Offload(pin_memory=True) if cpu_offload.offload_params else None


def _keep_full_precision(policy: Callable[..., Any] | None, mp: MixedPrecision | None) -> Callable[..., Any] | None:
    """Under an auto-wrap policy, modules of ``mp._module_classes_to_ignore`` become units of their own that
    run in full precision (torch's rule, batch norm by default)."""
    classes = tuple(getattr(mp, "_module_classes_to_ignore", ()) or ()) if mp is not None else ()
    if policy is None or not classes or getattr(mp, "param_dtype", None) is None:
        return policy

    def combined(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> Any:
        if recurse:
            return policy(module, recurse, nonwrapped_numel)
        if isinstance(module, classes):
            return {"mixed_precision": None, FULL_PRECISION_OUTPUT: mp.param_dtype}
        return policy(module, recurse, nonwrapped_numel)

    return combined


# The override by which _keep_full_precision marks the units it adds (their inputs and outputs are this dtype).
FULL_PRECISION_OUTPUT = "_fullshard_full_precision_output_dtype"


def plan_wrapper_units(
    module: nn.Module, policy: Callable[..., Any] | None, mp: MixedPrecision | None, ignored: list[nn.Module]
) -> list[UnitPlan]:
    """The submodules of ``module`` that become nested wrappers, innermost first: those ``policy`` selects, and
    under mixed precision the modules it must keep in full precision (see :func:`_keep_full_precision`)."""
    return plan_units(module, _keep_full_precision(policy, mp), ignored_modules=ignored, is_unit=is_unit)


def wrap_units(root: nn.Module, plans: list[UnitPlan], kwargs: dict[str, Any]) -> None:
    """Replace each planned submodule of ``root`` (innermost first) with a FullyShardedDataParallel of it."""
    if not plans:
        return
    parents = {id(child): (parent, name) for parent in root.modules() for name, child in parent.named_children()}
    for plan in plans:
        parent, name = parents[id(plan.module)]
        overrides = dict(plan.overrides)
        low_dtype = overrides.pop(FULL_PRECISION_OUTPUT, None)
        wrapped = FullyShardedDataParallel(plan.module, **{**kwargs, **overrides})
        if low_dtype is not None:
            _run_in_full_precision(wrapped, low_dtype)
        setattr(parent, name, wrapped)


def _run_in_full_precision(module: nn.Module, low_dtype: torch.dtype) -> None:
    """Inputs arrive in ``low_dtype``: compute in float32 and hand ``low_dtype`` on to the next module."""
    module.register_forward_pre_hook(lambda m, args: cast_floating(args, torch.float32))
    module.register_forward_hook(lambda m, args, output: cast_floating(output, low_dtype))

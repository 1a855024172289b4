"""``fully_shard``: the per-module entry point (torch FSDP2's surface) on the same engine.

``fully_shard(module)`` shards the parameters of ``module`` not already claimed by a ``fully_shard``
submodule, registers them as ``DTensor``s sharded on dim 0 over the mesh, and changes the module's class
to a subclass of both its class and :class:`FSDPModule` (so ``isinstance`` checks against either hold)
that adds ``unshard()``, ``reshard()``, ``set_requires_gradient_sync()`` and friends. Apply it bottom-up:
each block first, then the root.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fullshard.engine import grad_norm, invariant
from fullshard.engine import state_dict as sd
from fullshard.engine.api import BackwardPrefetch, MixedPrecisionPolicy, Offload, OffloadPolicy, StateDictType
from fullshard.engine.mesh import require_process_group, shard_group_from_mesh
from fullshard.engine.precision import casts_from_policy
from fullshard.engine.state import UnitConfig, UnitState, set_gradient_sync, unit_state, unit_states_in
from fullshard.engine.unit import Ignored, InitOptions, build_unit, resolve_device
from fullshard.ranks import warn_rank0

__all__ = ["FSDPModule", "fully_shard"]

M = TypeVar("M", bound=nn.Module)


class FSDPModule:
    """Methods gained by a module passed to :func:`fully_shard`."""

    def _fullshard_state(self) -> UnitState:
        state = unit_state(self)  # type: ignore[arg-type]
        if state is None:
            raise AssertionError(f"{type(self).__name__} is an FSDPModule without unit state")
        return state

    def unshard(self, async_op: bool = False) -> None:
        """Gather this module's parameters now (to overlap with other work when ``async_op``)."""
        group = self._fullshard_state().group
        if group is not None:
            group.unshard()
            if not async_op:
                group.wait_for_unshard()

    def reshard(self) -> None:
        """Free this module's gathered parameters; the sharded ones are registered again."""
        group = self._fullshard_state().group
        if group is not None:
            group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Off: backward accumulates unsharded gradients locally (like ``no_sync()``); on: reduce them."""
        states = unit_states_in(self) if recurse else [self._fullshard_state()]  # type: ignore[arg-type]
        set_gradient_sync(states, requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        states = unit_states_in(self) if recurse else [self._fullshard_state()]  # type: ignore[arg-type]
        for state in states:
            state.config = replace(state.config, reshard_after_forward=bool(reshard_after_forward))

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Prefetch in forward: with a non-empty list, this unit starts gathering the unit that ran after it
        in the first iteration as soon as its own parameters are gathered (an empty list turns it off)."""
        state = self._fullshard_state()
        state.config = replace(state.config, forward_prefetch=bool(modules))

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """Reduce this unit's and every inner unit's gradients with ``hook`` (signatures as in
        ``FullyShardedDataParallel.register_comm_hook``); call on the root before the first forward."""
        for unit in unit_states_in(self):  # type: ignore[arg-type]
            if unit.group is None:
                continue
            if unit.group.shard_group.replicate_pg is not None and unit.group.shard_group.shard_pg is not None:
                raise ValueError(
                    "register_comm_hook on a module sharded over a 2-D mesh: communication hooks cover one "
                    "reduction, and hybrid sharding needs two. Use a 1-D mesh with a hook, or no hook."
                )
            unit.group.set_comm_hook(state, hook)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of this (root) module's parameters to a global norm; return the norm before clipping.

        fullshard's addition to torch's ``FSDPModule`` (where ``torch.nn.utils.clip_grad_norm_`` over the ``DTensor``
        parameters does it). In world-size-invariant mode the norm is the same, bitwise, on every world size (torch's
        function over the ``DTensor`` parameters sums per-rank partial norms: not invariant)."""
        states = unit_states_in(self)  # type: ignore[arg-type]
        managed = {id(sp.sharded_param) for s in states if s.group for sp in s.group.params}
        others = [p for p in self.parameters() if id(p) not in managed]  # type: ignore[attr-defined]
        return grad_norm.clip_grad_norm_(states, others, max_norm, norm_type)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``nn.Module._apply`` (``to_empty``, ``.to``, ``.cuda``), then take the moved sharded parameters back
        into the unit's flat shard (see ``materialize.py``)."""
        state = self._fullshard_state()
        if state.group is not None:
            state.group.reshard()
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        if state.group is not None:
            state.group.adopt_applied_params(state.config.casts)
        return result

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load DTensors or full tensors under the module's keys; checked before anything is copied."""
        return sd.load_checked(self, state_dict, strict, assign, super().load_state_dict)  # type: ignore[arg-type,misc]


@functools.cache
def _fsdp_class(cls: type) -> type:
    if issubclass(cls, FSDPModule):
        return cls
    namespace = {"__module__": cls.__module__, "__new__": _constructs_original(cls)}
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), namespace)


def _constructs_original(original: type) -> Callable[..., Any]:
    """``__new__`` of a ``fully_shard`` class: constructing one (``model[1:3]`` of a sharded ``nn.Sequential`` calls
    ``type(model)(...)``) builds a plain ``original``, which has no unit and so must not claim to be an ``FSDPModule``
    (as torch's). ``cls.__new__(cls)`` without arguments (``copy`` and ``pickle``) still makes the subclass."""

    def construct(cls: type, *args: Any, **kwargs: Any) -> Any:
        new = original.__new__
        if not args and not kwargs:
            return new(cls)
        module = new(original) if new is object.__new__ else new(original, *args, **kwargs)
        module.__init__(*args, **kwargs)
        return module

    return construct


def _resolve_offload(policy: OffloadPolicy | None, device: torch.device) -> Offload | None:
    if policy is None or type(policy).__name__ == "OffloadPolicy":
        return None
    if not hasattr(policy, "pin_memory"):
        raise TypeError(
            f"fully_shard(offload_policy={policy!r}): pass CPUOffloadPolicy(pin_memory=...) to keep sharded "
            "parameters and gradients on the CPU, or OffloadPolicy() / None not to."
        )
    if policy.pin_memory and device.type == "cpu":
        warn_rank0(
            "CPUOffloadPolicy(pin_memory=True) has no effect here: the compute device is the CPU, so nothing is "
            "copied to an accelerator. Pass pin_memory=False to silence this.",
            stacklevel=3,
        )
    return Offload(pin_memory=bool(policy.pin_memory))


_DEFAULT_MESHES: dict[str, tuple[object, DeviceMesh]] = {}


def _default_mesh(device_type: str) -> DeviceMesh:
    """The 1-D mesh over the default process group, made once per group: a group created later (the process group
    destroyed and initialised again, e.g. with another world size) gets a mesh of its own."""
    world = dist.group.WORLD
    cached = _DEFAULT_MESHES.get(device_type)
    if cached is None or cached[0] is not world:
        cached = _DEFAULT_MESHES[device_type] = (world, init_device_mesh(device_type, (dist.get_world_size(),)))
    return cached[1]


def fully_shard(
    module: M,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    sync_module_states: bool = False,
    tp_mesh: DeviceMesh | None = None,
    invariant_micro_batches: int | None = None,
) -> M:
    """Shard ``module``'s parameters over ``mesh`` (1-D: shard; 2-D: (replicate, shard)); return ``module``.

    A module built on ``meta`` stays there (as with torch's ``fully_shard``): call ``model.to_empty(device=...)``
    and initialise the sharded parameters in place before the first forward (see ``materialize.py``).
    Parameters that are already ``DTensor``s over another dimension of the same mesh (tensor parallelism:
    ``parallelize_module(module, mesh["tp"], ...)`` before ``fully_shard(module, mesh=mesh["dp"])``) are
    sharded over ``mesh`` by their local tensors and become ``DTensor``s over the (dp, tp) mesh, as with torch's
    ``fully_shard``; see [Note: tensor parallel parameters] in ``mesh.py``.
    Beyond torch's signature, ``param_init_fn`` and ``sync_module_states`` mean what they mean for
    ``FullyShardedDataParallel``: they materialize this unit's meta-device modules at once (``param_init_fn``,
    else ``reset_parameters()``), and every rank takes rank 0's values (so that ranks other than 0 may build
    the model on ``meta``). ``tp_mesh`` (fullshard's, for Accelerate's ``ParallelismConfig``): the tensor parallel
    dimension of the same mesh; the unit's plain parameters are then replicated over it (their sharded form is a
    ``DTensor`` over (``mesh``'s dims, tp) placed ``Replicate()`` on tp), as Accelerate replicates the parameters
    a tensor parallel plan left plain; modules still compute with plain tensors.
    ``invariant_micro_batches=G`` (or ``FULLSHARD_INVARIANT_MICRO_BATCHES=G``) turns on world-size-invariant mode:
    for a fixed global batch cut into ``G`` micro-batches (a power of two, a multiple of the world size), the
    weights after every step are bitwise the same on any number of ranks; each rank runs its ``G/N`` consecutive
    micro-batches per step and the engine accumulates them; clip with :meth:`FSDPModule.clip_grad_norm_`. It takes
    float32 or bfloat16 parameters and ``param_dtype`` (float16 is refused) and sums gradients in float32 whatever
    ``reduce_dtype`` says. See [Note: world-size invariance] in ``invariant.py``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard(module=...) takes an nn.Module, got {type(module).__name__}.")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"fully_shard(reshard_after_forward={reshard_after_forward!r}): pass True (free parameters after "
            "forward, gather again in backward) or False (keep them until backward ends)."
        )
    if unit_state(module) is not None:
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; apply it once per module.")
    require_process_group("fully_shard")
    device = resolve_device(None, module)
    mesh = mesh if mesh is not None else _default_mesh(device.type)
    shard_group = shard_group_from_mesh(mesh, device)
    if tp_mesh is not None:
        shard_group = replace(shard_group, tp_mesh=tp_mesh)
    micro_batches = invariant.resolve(invariant_micro_batches, "fully_shard")
    config = UnitConfig(
        reshard_after_forward=reshard_after_forward,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=False,
        casts=casts_from_policy(mp_policy),
        invariant_micro_batches=micro_batches,
    )
    offload = _resolve_offload(offload_policy, device)
    ignored = Ignored(param_ids=frozenset(id(p) for p in (ignored_params or ())))
    # As torch's fully_shard: a meta-device module stays on meta (to_empty and the user's init come after).
    init = InitOptions(param_init_fn, bool(sync_module_states), materialize_meta=False)
    state = build_unit(
        module,
        shard_group,
        config,
        ignored=ignored,
        use_dtensor=True,
        guard_unit_module=False,
        offload=offload,
        init=init,
    )
    where = f"fully_shard({type(module).__name__})"
    if micro_batches is not None and state.group is not None:
        invariant.validate_group(state.group, micro_batches, where)
    sd.install_state_dict_hooks(module, state, default_type=StateDictType.SHARDED_STATE_DICT, segment="", where=where)
    module.__class__ = _fsdp_class(type(module))
    state.keep_hooks(
        module.register_forward_pre_hook(
            torch.compiler.disable(lambda m, args, kwargs: state.pre_forward(args, kwargs), recursive=True),
            prepend=True,
            with_kwargs=True,
        ),
        module.register_forward_hook(
            torch.compiler.disable(lambda m, args, output: state.post_forward(output), recursive=True)
        ),
    )
    return module

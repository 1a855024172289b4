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
from torch.distributed.tensor import Shard

from fullshard.engine import grad_norm, invariant, local_step
from fullshard.engine import state_dict as sd
from fullshard.engine.api import (
    AppliedTwiceError,
    BackwardPrefetch,
    MixedPrecisionPolicy,
    Offload,
    OffloadPolicy,
    StateDictType,
)
from fullshard.engine.group import ShardState
from fullshard.engine.mesh import require_process_group, shard_group_from_mesh
from fullshard.engine.precision import casts_from_policy
from fullshard.engine.reassign import adopt_replaced_params
from fullshard.engine.unit import Ignored, InitOptions, build_unit, resolve_device
from fullshard.engine.unit_state import (
    UnitConfig,
    UnitState,
    reset_iteration,
    set_gradient_sync,
    unit_state,
    unit_states_in,
)
from fullshard.ranks import warn_rank0

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method", "share_comm_ctx"]

M = TypeVar("M", bound=nn.Module)


class FSDPModule:
    """Methods gained by a module passed to :func:`fully_shard`."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A new instance of a sharded module's class built with arguments (``nn.Sequential`` slicing builds one with
        ``type(self)(...)``) is a plain instance of the original class: it has no unit, so it is no FSDPModule.
        Without arguments (``copy.copy``, unpickling) the class is kept, as the copy carries the unit's state."""
        if not args and not kwargs:
            return super().__new__(cls)
        original = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
        instance = original.__new__(original)
        instance.__init__(*args, **kwargs)
        return instance

    def _fullshard_state(self) -> UnitState:
        state = unit_state(self)  # type: ignore[arg-type]
        if state is None:
            raise AssertionError(f"{type(self).__name__} is an FSDPModule without unit state")
        return state

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's parameters now. With ``async_op``, return an :class:`UnshardHandle` whose ``wait()``
        finishes the gather (the module's next forward waits for it too); otherwise wait here and return None."""
        group = self._fullshard_state().group
        if group is not None:
            if group.state is ShardState.SHARDED:
                adopt_replaced_params(group)  # before a first forward too (reassign.py)
            group.unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise AssertionError(
            f"copy.deepcopy({type(self).__name__}): FSDP does not support deepcopy of a sharded module (its "
            "parameters are shards bound to process groups and to the unit's buffers). Deep-copy the model before "
            "fully_shard, or build a fresh model and load this one's state_dict() into it."
        )

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
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward({reshard_after_forward!r}): pass True or False (an int is accepted only "
                "by fully_shard(reshard_after_forward=...))."
            )
        for state in self._states(recurse):  # as torch: an explicit setting applies to the root too
            state.config = replace(
                state.config,
                reshard_after_forward=reshard_after_forward,
                reshard_root_after_forward=reshard_after_forward,
            )

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Accepted for torch's API. fullshard always frees gathered parameters at the end of backward (the next
        forward gathers again, as torch does after an optimizer step); gradients and values are the same."""
        self._states(recurse)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch's API: every backward here waits for its reductions before it returns, which is what
        torch does on the backward marked last."""
        self._fullshard_state()

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: off, backward reduce-scatters and sums locally; the all-reduce across replicas (and the
        gradients' update) waits for the next backward with it on (gradient accumulation with less traffic)."""
        self._set_comm(recurse, requires_all_reduce=bool(requires_all_reduce))

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Accepted for torch's API: backward prefetches the unit that runs backward next (the one whose forward
        ended just before this one's, torch's default); the order changes when collectives start, never the
        results."""
        _check_modules("set_modules_to_backward_prefetch", modules)
        self._fullshard_state()

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Accepted for torch's API: fullshard gathers a unit in backward whenever autograd reaches it."""
        self._fullshard_state()

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted for torch's API: with no streams on CPU, the next forward's gathers already follow the
        optimizer step."""
        self._fullshard_state()

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(output)`` on every reduced gradient shard of this module's own unit (not recursive, as in
        torch), after the reduce-scatter
        (and after the all-reduce across replicas under HSDP), before ``.grad`` is written: it may change ``output``
        in place (e.g. all-reduce it over a group of your own)."""
        if stream is not None and any(
            s.group.shard_group.replicate_pg is not None
            for s in unit_states_in(self)
            if s.group  # type: ignore[arg-type]
        ):
            raise ValueError("stream cannot be set when using native HSDP")
        self._set_comm(False, all_reduce_hook=hook)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's summed gradients by ``factor`` instead of the number of data parallel ranks (this
        module's own unit, not recursive, as in torch: call it on each module ``fully_shard`` was applied to)."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor({factor!r}): pass a positive number.")
        self._set_comm(False, divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor` (as in torch)."""
        warn_rank0("set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor.", stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with sums and divide apart (this module's own unit). fullshard always does (gloo has no average);
        on, the all-reduce hook sees the undivided sum, as with torch's sum reductions."""
        self._set_comm(False, force_sum=bool(enable))

    def set_custom_all_gather(self, comm: Any) -> None:
        """Gather this unit's parameters with ``comm`` (torch's ``AllGather`` interface: ``comm(output_tensor,
        input_tensor, group, async_op=...)``) instead of the built-in all-gather."""
        self._set_comm(False, all_gather=comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce this unit's gradients with ``comm`` (torch's ``ReduceScatter`` interface: ``allocate(size, dtype=,
        device=)`` and ``comm(output_tensor, input_tensor, group, op, async_op=...)``; ``op`` is a sum, the average
        is taken after it)."""
        self._set_comm(False, reduce_scatter=comm)

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: free every gathered unit, drop reductions in flight
        and the iteration's bookkeeping, so that the next iteration starts clean (call on the root)."""
        state = self._fullshard_state()
        if state.ctx is not None and state.ctx.root is not state:
            raise RuntimeError(
                f"reset_iter_state() on {type(self).__name__}, which is not the root: call it on the module "
                "fully_shard was applied to last (the one whose forward you call)."
            )
        reset_iteration(state)

    def _states(self, recurse: bool) -> list[UnitState]:
        return unit_states_in(self) if recurse else [self._fullshard_state()]  # type: ignore[arg-type]

    def _set_comm(self, recurse: bool, **changes: Any) -> None:
        for state in self._states(recurse):
            if state.group is not None:
                state.group.comm_options = replace(state.group.comm_options, **changes)

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
        return grad_norm.clip_module_grad_norm_(self, max_norm, norm_type)  # type: ignore[arg-type]

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


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` finishes the gather (idempotent)."""

    def __init__(self, group: Any) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


def _check_modules(where: str, modules: Any) -> None:
    bad = [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]
    if bad:
        raise ValueError(f"{where}: every module must have had fully_shard applied; these have not: {bad}.")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` gather and free parameters as ``module(...)`` does (e.g. ``generate``)."""
    if not isinstance(module, FSDPModule):
        raise ValueError(
            f"register_fsdp_forward_method({type(module).__name__}, {method_name!r}): the module must have had "
            "fully_shard applied first."
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}.")
    state = module._fullshard_state()

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(args, kwargs)
        return state.post_forward(method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Accepted for torch's API (sharing CUDA streams between roots): on CPU there are no streams to share."""
    _check_modules("share_comm_ctx", modules)


def _user_class(module: nn.Module) -> type:
    """The class ``module`` had before :func:`_fsdp_class` swapped it."""
    bases = type(module).__bases__
    return bases[1] if len(bases) == 2 and bases[0] is FSDPModule else type(module)


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


def _resolve_reshard(value: bool | int | None, shard_size: int) -> bool:
    """``reshard_after_forward`` as the engine takes it. ``None`` (torch's default): True, and the root keeps its
    parameters (``UnitConfig.reshard_root_after_forward`` is set for an explicit value only). An int ``k`` (torch:
    reshard to groups of ``k`` ranks after forward, to gather within them in backward) must divide the shard group's
    size; 1 means False, any other divisor frees everything as True does (the same values; fullshard has no
    intermediate resharding, see docs/design.md)."""
    if value is None:
        return True
    if isinstance(value, bool):
        return value
    if not isinstance(value, int) or value < 1 or shard_size % value:
        raise ValueError(
            f"fully_shard(reshard_after_forward={value!r}): pass True, False, None (the default), or an int that "
            f"divides the shard group's size {shard_size}."
        )
    return value != 1


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
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    sync_module_states: bool = False,
    tp_mesh: DeviceMesh | None = None,
    invariant_micro_batches: int | None = None,
) -> M:
    """Shard ``module``'s parameters over ``mesh`` (1-D: shard; 2-D: (replicate, shard)); return ``module``.

    ``module`` may be a list of modules, which become one unit (one all-gather per forward, as torch; see
    [Note: a unit of several modules] in ``unit_state.py``); it must sit below a root unit.

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
    given, members = module, []
    if isinstance(module, (list, tuple)) and module and all(isinstance(m, nn.Module) for m in module):
        # [Note: a unit of several modules] in engine/unit_state.py: as torch, the listed modules are one unit (one
        # group, one all-gather per forward); the first one carries the unit, the others join it.
        module, members = _check_members(list(module))  # type: ignore[assignment]
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"fully_shard(module=...) takes an nn.Module or a non-empty list of them, got {type(module).__name__}."
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):  # bool is an int
        raise ValueError(
            f"fully_shard(reshard_after_forward={reshard_after_forward!r}): pass True, False, None (the default), or "
            "an int that divides the shard group's size."
        )
    if unit_state(module) is not None:
        raise AppliedTwiceError(  # torch's sentence first: torch's own tests and users' code match on it
            f"Each distinct composable distributed API can only be applied to a module once. fully_shard was already "
            f"applied to this {_user_class(module).__name__}; apply it once per module."
        )
    for m in [module, *members] if members else []:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: got a {type(m).__name__} "
                "in the list. List the modules whose forward runs instead."
            )
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        # The opening words are torch fully_shard's, which users' code matches on.
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: got a {type(module).__name__}. "
            "Apply fully_shard to each module in it, or to the module whose forward calls them."
        )
    require_process_group("fully_shard")
    device = resolve_device(None, module)
    mesh = mesh if mesh is not None else _default_mesh(device.type)
    shard_group = shard_group_from_mesh(mesh, device)
    if tp_mesh is not None:
        shard_group = replace(shard_group, tp_mesh=tp_mesh)
    micro_batches = invariant.resolve(invariant_micro_batches, "fully_shard")
    if micro_batches is not None and shard_placement_fn is not None:
        raise ValueError(
            "fully_shard(shard_placement_fn=..., invariant_micro_batches=...): world-size-invariant mode shards on "
            "dim 0 only. Drop shard_placement_fn, or turn invariant mode off."
        )
    reshards = _resolve_reshard(reshard_after_forward, shard_group.shard_size)
    config = UnitConfig(
        reshard_after_forward=reshards,
        # torch: None (the default) keeps the root gathered after forward; an explicit True (or k) reshards it too
        reshard_root_after_forward=reshards and reshard_after_forward is not None,
        expose_gathered_after_forward=True,
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
        shard_placement_fn=shard_placement_fn,
        members=members,
    )
    local_step.install()  # after build_unit retired the originals: the retired-parameter guard is the first hook
    where = f"fully_shard({type(module).__name__})"
    if micro_batches is not None and state.group is not None:
        invariant.validate_group(state.group, micro_batches, where)
    for m in [module, *members]:
        sd.install_state_dict_hooks(m, state, default_type=StateDictType.SHARDED_STATE_DICT, segment="", where=where)
        m.__class__ = _fsdp_class(type(m))
        state.keep_hooks(
            m.register_forward_pre_hook(
                torch.compiler.disable(lambda m, args, kwargs: state.pre_forward(args, kwargs), recursive=True),
                prepend=True,
                with_kwargs=True,
            ),
            m.register_forward_hook(
                torch.compiler.disable(lambda m, args, output: state.post_forward(output), recursive=True)
            ),
        )
    return given


def _check_members(modules: list[nn.Module]) -> tuple[nn.Module, list[nn.Module]]:
    """The first listed module and the others, checked: distinct, none inside another, none a unit already."""
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard([...]): a module is listed twice. List each module once.")
    for m in modules:
        if unit_state(m) is not None:
            raise ValueError(
                f"fully_shard([...]): the listed {type(m).__name__} is a unit already; apply fully_shard once per "
                "module."
            )
        for other in modules:
            if other is not m and any(sub is other for sub in m.modules()):
                raise ValueError(
                    f"fully_shard([...]): the listed {type(other).__name__} is inside the listed {type(m).__name__}. "
                    "List modules of which none holds another (or shard the inner one first, on its own)."
                )
    return modules[0], modules[1:]


def _state_of(module: nn.Module) -> UnitState | None:
    """``fully_shard.state(module)``: the unit state ``fully_shard`` attached to ``module`` (None if none)."""
    return unit_state(module)


fully_shard.state = _state_of  # type: ignore[attr-defined]

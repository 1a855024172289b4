"""Per-unit runtime state and the hooks that drive gather, free and reduce around forward and backward.

This module holds ``UnitState`` (lazy init, the forward and backward hooks, the root's final callback) and the
lookups of units in a model; beside it, ``root_context.py`` (what the root shares with its units: the recorded
forward order, the backward pass under way, and the prefetch and keep-spare decisions drawn from them),
``direct_calls.py`` (the guard against calling a module inside a sharded unit directly), ``frozen_backward.py``
(when a unit without trainable parameters is done with backward) and ``agreement.py`` (the checks that every rank
built the same units and runs them in one order).

[Note: one iteration]
- Root pre-forward (lazy init on the first call): the outermost unit called becomes the root; it finds
  every unit below it, checks that all ranks built the same units (one ``all_gather_object``), and on the
  first iteration records the order units run forward in.
- Unit pre-forward: gather the unit's parameters (unless prefetched), then prefetch the next unit in the
  recorded forward order when ``forward_prefetch`` is on.
- Unit post-forward: free the gathered parameters when ``reshard_after_forward`` (for the root only when set
  explicitly: backward needs them at once) or under ``no_grad``. A unit kept gathered leaves its gathered
  tensors registered until it reshards (``fully_shard``, as torch) or registers the sharded ones again (the
  FSDP wrapper, ``ParamGroup.expose_sharded``). Then hook the unit's output tensors so that the unit's
  pre-backward runs when their gradient is ready.
- Unit pre-backward: gather again if freed; with ``BACKWARD_PRE`` prefetch the unit that runs backward
  next (the previous one in forward order). The first pre-backward of a backward pass queues the root's
  final callback.
- Unit post-backward (the unit's flat-gradient hook, see [Note: group buffers]): start the reduce-scatter
  asynchronously (unless gradient sync is off, e.g. inside ``no_sync()``), free the gathered parameters,
  and with ``BACKWARD_POST`` prefetch the next unit. At most ``_reductions_in_flight()`` reductions are
  left in flight (none on gloo).
- A unit without trainable parameters has no gradient, hence no post-backward of its own: it is freed once the
  gradients of its forward inputs are computed (``frozen_backward.py``), not at the final callback.
- Recomputation (activation checkpointing) in backward gathers a unit for the recomputed forward; a unit inside
  the recomputed region is freed again after it (see [Note: recomputation frees what it gathered]).
- Root final callback (end of ``backward()``): reduce units that ran forward but got no gradient (zeros,
  so that every rank issues the same collectives), wait for every reduction and land it in ``.grad``,
  free anything still gathered. So ``optimizer.step()`` right after ``backward()`` sees final gradients.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fullshard.engine import collective_check, cpu_memory, invariant, local_step, shm, trace
from fullshard.engine.agreement import check_same_order_on_all_ranks, check_same_units_on_all_ranks
from fullshard.engine.api import BackwardPrefetch
from fullshard.engine.frozen_backward import FrozenBackward
from fullshard.engine.group import ParamGroup, ShardState
from fullshard.engine.mesh import is_gloo, simulating
from fullshard.engine.names import STATE_ATTR, clean_key
from fullshard.engine.precision import Casts, cast_floating
from fullshard.engine.reassign import adopt_replaced_params
from fullshard.engine.root_context import (
    ForwardOrder,
    RootContext,
    next_gather_fits,
    prefetch,
    prefetch_backward,
    reshard_leftovers,
)
from fullshard.ranks import global_rank, warn_rank0

__all__ = ["TrainingState", "UnitConfig", "UnitState", "has_units", "is_unit", "unit_state", "unit_states_in"]

MAX_REDUCTIONS_IN_FLIGHT: int | None = None
"""Reductions a backward leaves running while the next units compute (``None``: by backend, see
:func:`_reductions_in_flight`). Each holds the unit's unsharded gradient (a unit's parameter bytes) until it
completes, on top of the two units gathered at that moment and the gradient being computed."""


def _reductions_in_flight(group: ParamGroup) -> int:
    """0 on gloo: its all-reduce runs on the same CPU cores as the backward, so overlapping buys little, and
    waiting at each unit's post-backward keeps the peak at torch FSDP2's (which reduces synchronously on
    CPU); 1 elsewhere (NCCL reduces on its own stream while the next unit computes). Measured in
    docs/benchmarks.md, "Training at scale"."""
    if MAX_REDUCTIONS_IN_FLIGHT is not None:
        return MAX_REDUCTIONS_IN_FLIGHT
    pg = group.shard_group.shard_pg or group.shard_group.replicate_pg
    return 0 if is_gloo(pg) else 1


class TrainingState(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()


@dataclass(frozen=True)
class UnitConfig:
    """How one unit behaves at runtime (resolved from the entry point's arguments once)."""

    reshard_after_forward: bool = True
    # The root too (torch's ``fully_shard(root, reshard_after_forward=True)`` given explicitly, or set later with
    # ``set_reshard_after_forward``); by default the root keeps its parameters gathered for the backward that follows.
    reshard_root_after_forward: bool = False
    # After a forward that keeps the parameters gathered, leave the gathered (plain) tensors registered until the
    # unit reshards, as torch's ``fully_shard``; off (the FSDP wrapper): register the sharded parameters again.
    expose_gathered_after_forward: bool = False
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    casts: Casts = field(default_factory=Casts)
    # While gradient sync is off, show each parameter's unreduced local gradient as its .grad (torch's FSDP1
    # does, for every strategy); torch's FSDP2 leaves the sharded .grad alone until the synchronised backward.
    expose_unsynced_grads: bool = False
    # World-size-invariant mode: G micro-batches per step, summed in one fixed tree (see invariant.py); None: off.
    invariant_micro_batches: int | None = None


def unit_state(module: nn.Module) -> UnitState | None:
    """The unit state of ``module`` if it is a unit (an FSDP wrapper or a ``fully_shard`` module)."""
    return module.__dict__.get(STATE_ATTR)


def unit_states_in(module: nn.Module) -> list[UnitState]:
    """The unit states in ``module``'s tree, pre-order (parents before children), each once (the modules of a
    ``fully_shard([m0, m1])`` unit share one)."""
    states = [s for m in module.modules() if (s := m.__dict__.get(STATE_ATTR)) is not None]
    return list({id(s): s for s in states}.values())


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` itself is a unit (a ``FullyShardedDataParallel`` wrapper or a ``fully_shard`` module)."""
    return unit_state(module) is not None


def has_units(module: nn.Module) -> bool:
    """Whether any module in ``module``'s tree is a unit (a model never sharded has none)."""
    return any(is_unit(m) for m in module.modules())


class UnitState:
    """The runtime state of one unit; see [Note: one iteration]."""

    def __init__(
        self,
        module: nn.Module,
        group: ParamGroup | None,
        config: UnitConfig,
        label: str,
        own_modules: list[nn.Module] | None = None,
    ) -> None:
        self.module = module
        self.own_modules = own_modules or []  # modules whose buffers belong to this unit
        self.group = group
        self.config = config
        self.label = label
        self.class_name = label  # the module's class name, kept when the label becomes a path at lazy init
        self.ctx: RootContext | None = None
        self.training_state = TrainingState.IDLE
        self.requires_gradient_sync = True
        self.frozen_backward = FrozenBackward(self._post_backward_frozen)
        self.ran_forward = False
        self.reduced = False
        self.hook_handles: list[RemovableHandle] = []  # every hook registered for this unit, removable
        # [Note: a unit of several modules] fully_shard([m0, m1]): one group for the listed modules, each with the
        # unit's hooks. A forward round gathers once at the first member's forward and reshards after the last
        # member's (``members`` forwards); backward needs nothing more (the group's gradients come ready together).
        self.members = [module]
        self.member_names = [label]  # class names, taken before fully_shard changes the classes
        self._round_left = 0
        # Whether this iteration ran a forward of the unit with autograd on, and whether an output of one carries
        # the pre-backward hook (the unit will be gathered for backward). Backward prefetching skips a unit that
        # ran with autograd and got no hook (``no_backward``: a frozen embedding fed token ids); recomputation
        # frees what it gathered only for a hooked unit ([Note: recomputation frees what it gathered]).
        self.forward_with_grad = False
        self.backward_hooked = False
        self._gathered_for_recompute = False
        if group is not None:
            group.observe(on_grads_ready=self.post_backward, on_state_change=self._group_state_changed)
        # [Note: hooks outside compiled graphs] torch.compile must not trace the forward hooks: they issue
        # collectives (gloo's point-to-point ops are not traceable), swap parameter storage and keep Python
        # state. Disabled for dynamo, they run eagerly between the compiled graphs of the modules they wrap, as
        # torch FSDP2's hooks do; the backward hooks run in autograd's engine, outside any graph already.
        # fully_shard registers disabled functions as the module hooks themselves: dynamo then calls them from
        # the compiled module's call without breaking its graph (a traced hook that calls a disabled function
        # would break it); the FSDP class's forward calls these two methods, where a break is unavoidable.
        self.pre_forward = torch.compiler.disable(self.pre_forward, recursive=True)  # type: ignore[method-assign]
        self.post_forward = torch.compiler.disable(self.post_forward, recursive=True)  # type: ignore[method-assign]
        module.__dict__[STATE_ATTR] = self

    def attach(self, member: nn.Module) -> None:
        """Make ``member`` one more module of this unit (see [Note: a unit of several modules])."""
        self.members.append(member)
        self.member_names.append(type(member).__name__)
        member.__dict__[STATE_ATTR] = self

    def keep_hooks(self, *handles: RemovableHandle) -> None:
        """Remember hooks registered for this unit, so that they can be removed."""
        self.hook_handles.extend(handles)

    def signature(self) -> tuple[Any, ...]:
        """What every rank must agree on: the unit's name and its parameters' names, shapes and dtypes."""
        params = [] if self.group is None else [(sp.fqn, sp.shape, str(sp.dtype)) for sp in self.group.params]
        label = self.label
        if self.config.invariant_micro_batches is not None:  # ranks must agree on the mode too
            label = f"{label} (invariant_micro_batches={self.config.invariant_micro_batches})"
        return (label, tuple(params))

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    def __repr__(self) -> str:
        return f"UnitState({self.label!r})"

    # --- lazy init ----------------------------------------------------------------------------------

    def _lazy_init(self) -> None:
        """Make this unit the root of every unit in its tree and check all ranks agree on them."""
        if len(self.members) > 1:
            raise ValueError(
                f"fully_shard([{', '.join(self.member_names)}]) ran forward as the root unit: a "
                "unit of several modules must sit below a root. Apply fully_shard to a module that holds them all "
                "(after the list), and call that module."
            )
        states = unit_states_in(self.module)
        ctx = RootContext(self, states)
        names = {id(m): clean_key(n) for n, m in self.module.named_modules()}
        for state in states:
            state.ctx = ctx
            state.label = names.get(id(state.module)) or f"<root {state.class_name}>"
            state._cast_buffers()
            if state.group is not None:
                state.group.rename(state.label)  # errors about its collectives name the path
                state.group.spare = ctx.spare
        for state in states:
            if state.group is not None:
                adopt_replaced_params(state.group)  # parameters assigned after sharding (reassign.py)
        ctx.gathered = sum(1 for s in states if s is not self and s.group and s.group.state is not ShardState.SHARDED)
        if any(s.group is not None and s.group.device.type == "cpu" for s in states):
            # freed unit-sized buffers reused, not faulted in again (cpu_memory.py); the shared regions alike
            kept = cpu_memory.keep_freed_memory()
            if not simulating():
                shm.connect(keep_idle_regions=kept)  # ranks of one host skip the sockets (shm.py)
        if not simulating():  # a planning run steps meta units on purpose (see mesh.simulating)
            _refuse_meta(states)
        invariant.check_one_mode(states)
        check_same_units_on_all_ranks(states)

    def _group_state_changed(self, old: ShardState, new: ShardState) -> None:
        ctx = self.ctx
        if ctx is None or ctx.root is self:
            return
        if old is ShardState.SHARDED:
            ctx.gathered += 1
        elif new is ShardState.SHARDED:
            ctx.gathered -= 1

    def _cast_buffers(self) -> None:
        dtype = self.config.casts.buffer_dtype
        if dtype is None:
            return
        for module in self.own_modules:
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                    module._buffers[name] = buf.to(dtype)

    # --- forward ------------------------------------------------------------------------------------

    def pre_forward(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> tuple[Any, Any]:
        """Gather this unit's parameters (and prefetch); return the forward inputs, cast if configured."""
        with trace.phase(trace.PRE_FORWARD):
            self._pre_forward()
        casts = self.config.casts
        dtype = casts.root_input_dtype if self.is_root else casts.input_dtype
        kwargs = kwargs or {}
        if dtype is not None:
            args, kwargs = cast_floating(args, dtype), cast_floating(kwargs, dtype)
        group, ctx = self.group, self.ctx
        frozen = group is not None and not group.requires_grad
        if frozen and ctx is not None and not ctx.backward.in_backward and torch.is_grad_enabled():
            args, kwargs = self.frozen_backward.wrap(args, kwargs)  # see frozen_backward.py
        return args, kwargs

    def _pre_forward(self) -> None:
        if self.ctx is None:
            self._lazy_init()
        ctx = self.ctx
        if ctx is None:
            raise AssertionError(f"[rank {global_rank()}] {self.label}: no root context after lazy init")
        if ctx.backward.in_backward:
            # [Note: recomputation frees what it gathered] Recomputation (activation checkpointing) during backward:
            # parameters are needed, nothing else. A unit inside a checkpointed region (LoRA's projections in a
            # recomputed decoder layer) is recomputed before its own backward begins; kept gathered until then,
            # every unit of the region would be gathered at once (a whole layer: what small units are meant to
            # avoid). So when this recomputation gathers a one-module unit whose backward has not begun and whose
            # forward output carries the pre-backward hook (non-reentrant checkpointing: gradients flow through the
            # original graph, so that hook gathers the unit again), post_forward frees it again if the unit frees
            # after forward. Otherwise (reentrant checkpointing, whose recomputed graph is the one differentiated
            # and has no hook; a unit already gathered for its backward or prefetched) it stays gathered.
            self._gathered_for_recompute = (
                self.backward_hooked
                and len(self.members) == 1
                and self.training_state is not TrainingState.PRE_BACKWARD
                and self.group is not None
                and self.group.state is ShardState.SHARDED
            )
            self._unshard_now()
            ctx.note_gathered()
            return
        if len(self.members) > 1 and self._round_left > 0:  # a later member of this unit's round: gathered already
            self._unshard_now()
            return
        self._round_left = len(self.members)
        self.training_state = TrainingState.FORWARD
        self.ran_forward = True
        if self.group is not None:
            self.group.forget_cleared_unsharded_grads()
        order = ctx.order
        if self.is_root:
            local_step.restore_all()  # an optimizer step that raised (see [Note: local optimizer steps])
            collective_check.note_forward()
            order.start_iteration()
            for state in ctx.states:  # a round a member never closed (it did not run) ends with the iteration
                state._round_left = len(state.members) if state is self else 0
        self._unshard_now()
        if not order.frozen:
            order.units.append(self)
        else:
            self._check_order(order)
            if self.config.forward_prefetch and not order.changed:
                prefetch(ctx, order.next(self, 1))
        order.cursor += 1
        order.this_iteration.append(self.label)
        ctx.note_gathered()

    def _check_order(self, order: ForwardOrder) -> None:
        """Compare with the first iteration's order; prefetching stops at the first difference."""
        expected = order.units[order.cursor] if order.cursor < len(order.units) else None
        if expected is self or order.changed:
            return
        order.changed = True
        where = expected.label if expected is not None else "nothing (the recorded order had ended)"
        message = (
            f"unit {self.label!r} ran forward as unit #{order.cursor}, where the first iteration ran {where}: the "
            "order of units changed"
        )
        if collective_check.debug_enabled():
            raise RuntimeError(f"[rank {global_rank()}] {message}. Every iteration must run units in one order.")
        if self.config.forward_prefetch:
            warn_rank0(
                f"forward_prefetch=True, but {message}; prefetching stops for this model and units are gathered "
                "when they run. Turn forward_prefetch off for models whose forward order varies.",
                stacklevel=4,
            )

    def post_forward(self, output: Any) -> Any:
        ctx = self.ctx
        if ctx is None:
            return output
        if ctx.backward.in_backward:
            if self._gathered_for_recompute and self.group is not None and self._reshards_after_forward():
                with trace.phase(trace.POST_FORWARD):
                    self.group.reshard()
            self._gathered_for_recompute = False
            return output
        with trace.phase(trace.POST_FORWARD):
            self._round_left -= 1
            if len(self.members) > 1 and self._round_left > 0:  # members still to run forward: stay gathered
                output = cast_floating(output, self.config.casts.output_dtype)
                if torch.is_grad_enabled():
                    self.forward_with_grad = True
                    self.backward_hooked |= _register_on_tensors(output, self._pre_backward_hook)
                return output
            self._round_left = 0
            if not ctx.order.frozen:
                ctx.order.finished.append(self)
            if self.group is not None:
                if self._reshards_after_forward():
                    self.group.reshard(keep_spare=next_gather_fits(ctx, self, 1))
                elif not self.config.expose_gathered_after_forward:
                    # The FSDP wrapper: kept gathered for backward, but parameters() yields the leaves the optimizer
                    # steps on (a forward without backward, e.g. a sanity check, may come before it is built).
                    self.group.expose_sharded()
            if self.is_root:
                if not ctx.order.frozen:
                    ctx.order.freeze()
                reshard_leftovers(ctx)
                ctx.spare.drop()
                if collective_check.debug_enabled():
                    check_same_order_on_all_ranks(ctx.order.this_iteration)
            self.training_state = TrainingState.IDLE
            output = cast_floating(output, self.config.casts.output_dtype)
            if torch.is_grad_enabled():
                self.forward_with_grad = True
                self.backward_hooked |= _register_on_tensors(output, self._pre_backward_hook)
            return output

    @property
    def no_backward(self) -> bool:
        """This iteration's forward ran with autograd on and no output needs a gradient: the unit has no backward
        to be gathered for. (A forward under ``no_grad``, e.g. inside reentrant checkpointing, says nothing.)"""
        return self.forward_with_grad and not self.backward_hooked

    def _reshards_after_forward(self) -> bool:
        """Whether this forward ends by freeing the unit's gathered parameters: always under ``no_grad`` (no backward
        will need them), else by ``reshard_after_forward`` (for the root: only if asked for explicitly)."""
        config = self.config
        if not torch.is_grad_enabled():
            return True
        return config.reshard_after_forward and (not self.is_root or config.reshard_root_after_forward)

    def _unshard_now(self) -> None:
        if self.group is not None:
            self.group.unshard()
            self.group.wait_for_unshard()

    # --- backward -----------------------------------------------------------------------------------

    def _pre_backward_hook(self, grad: torch.Tensor) -> torch.Tensor:
        self.pre_backward()
        return grad

    def pre_backward(self) -> None:
        ctx = self.ctx
        if ctx is None:
            return
        ctx.backward.begin(ctx.root._final_callback)
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        with trace.phase(trace.PRE_BACKWARD):
            self.training_state = TrainingState.PRE_BACKWARD
            self._unshard_now()
            if self.config.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
                prefetch_backward(ctx, self)
            ctx.note_gathered()

    def _post_backward_frozen(self) -> None:
        """A unit without trainable parameters is done with backward (``frozen_backward.py``): free it now, not at
        the final callback; a later pre-backward of it (another use of an output) gathers it again."""
        if self.group is not None and self.ctx is not None and self.ctx.backward.in_backward:
            with trace.phase(trace.POST_BACKWARD):
                self.group.reshard()
                self.training_state = TrainingState.POST_BACKWARD

    def post_backward(self) -> None:
        """Runs when every parameter of the unit has its gradient for this backward pass."""
        ctx, group = self.ctx, self.group
        if ctx is None or group is None:
            return
        with trace.phase(trace.POST_BACKWARD):
            self.training_state = TrainingState.POST_BACKWARD
            if self.config.invariant_micro_batches is not None:
                invariant.fold_backward(self)  # accumulates; reduces on the rank's last micro-batch of the step
            elif self.requires_gradient_sync:
                group.reduce_grads()
                self.reduced = True
                ctx.backward.in_flight.append(group)
            elif self.config.expose_unsynced_grads:
                group.expose_unsharded_grads()
            else:
                group.hold_unsynced_grad()
            # Free the gathered parameters before blocking on older reductions: they are not needed any more.
            group.reshard(keep_spare=next_gather_fits(ctx, self, -1))
            ctx.backward.settle(_reductions_in_flight(group))
            if self.config.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
                prefetch_backward(ctx, self)

    def _final_callback(self) -> None:
        ctx = self.ctx
        if ctx is None:
            raise AssertionError(f"[rank {global_rank()}] {self.label}: final callback without a root context")
        with trace.phase(trace.FINAL_CALLBACK):
            try:
                if self.config.invariant_micro_batches is not None:  # every unit's mode is the root's (check_one_mode)
                    invariant.fold_leftovers(ctx.states)
                for state in ctx.states:
                    group = state.group
                    if group is None or state.config.invariant_micro_batches:
                        continue
                    if not state.requires_gradient_sync:
                        if not state.config.expose_unsynced_grads:
                            group.hold_unsynced_grad()  # a unit whose post-backward did not run
                            if group.extension is not None:
                                group.extension.hold_unsynced_grads()
                        continue
                    if state.ran_forward and not state.reduced and group.requires_grad:
                        group.reduce_grads()
                    if group.extension is not None:
                        group.extension.reduce_grads(group.comm_options)  # trainable subclass params (extension.py)
                for state in ctx.states:
                    if state.group is not None:
                        state.group.finish_reduce()
                        state.group.reshard()
            finally:
                ctx.backward.end()
                ctx.spare.drop()
                for state in ctx.states:
                    state.end_iteration()

    def end_iteration(self) -> None:
        """Forget this iteration's progress (at the final callback, or after an aborted iteration)."""
        self.training_state = TrainingState.IDLE
        self.ran_forward = self.reduced = False
        self.forward_with_grad = self.backward_hooked = False
        self.frozen_backward.reset()


def reset_iteration(root: UnitState) -> None:
    """``FSDPModule.reset_iter_state``: after an exception aborted a forward or backward, wait for started
    collectives, free every gathered unit, drop this iteration's gradients in flight and bookkeeping (the
    recorded forward order stays), so that the next iteration starts as after a clean one."""
    ctx = root.ctx
    if ctx is None:
        return
    for state in ctx.states:
        group = state.group
        if group is not None:
            group.drop_reductions()
            if group.extension is not None:
                group.extension.drop_grads()
            group.reshard()
        state.end_iteration()
    ctx.backward.end()
    ctx.spare.drop()
    ctx.order.cursor = 0
    ctx.order.this_iteration.clear()
    ctx.gathered = 0


def _refuse_meta(states: list[UnitState]) -> None:
    """Parameters left on meta by ``fully_shard`` must be given storage before the first forward."""
    names = [f"{s.label}: {n}" for s in states if s.group is not None for n in s.group.meta_parameter_names()]
    if names:
        raise RuntimeError(
            f"parameters still on the meta device at the first forward: {names[:5]}{' ...' if len(names) > 5 else ''}"
            ". Materialize the sharded model first: model.to_empty(device=...), then initialise the values in place "
            "(reset_parameters() on each module, or your init_weights()); or pass param_init_fn=... to fully_shard."
        )


def _register_on_tensors(output: Any, hook: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Register ``hook`` on every tensor in ``output`` that requires grad; whether there was one."""
    registered = False
    for tensor in _tensors_in(output):
        if tensor.requires_grad:
            tensor.register_hook(hook)
            registered = True
    return registered


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors_in(getattr(obj, name))


def set_gradient_sync(states: list[UnitState], enabled: bool) -> list[bool]:
    """Set gradient sync on ``states``; return the previous values (for restoring)."""
    previous = [s.requires_gradient_sync for s in states]
    for s in states:
        s.requires_gradient_sync = enabled
    return previous


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Within the block, every unit in ``module`` reduces its gradients (``enabled``) or keeps them local; the
    previous settings come back on exit (``no_sync`` and Accelerate's ``trigger_sync_in_backward``)."""
    states = unit_states_in(module)
    previous = set_gradient_sync(states, enabled)
    try:
        yield
    finally:
        for state, value in zip(states, previous, strict=True):
            state.requires_gradient_sync = value

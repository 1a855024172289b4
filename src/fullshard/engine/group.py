"""ParamGroup: the parameters of one unit, which are gathered, freed and reduced together.

This module owns the group's buffers and layout (built in ``__init__``) and the SHARDED/UNSHARDING/UNSHARDED state
machine: the gather (``unshard``, ``wait_for_unshard``), the views modules compute with, and ``reshard``. Two jobs
live beside it in classes ``ParamGroup`` mixes in, which read the fields ``__init__`` sets and keep none of their
own: its gradients, from the post-backward leaf to the sharded ``.grad`` (``group_grads.py``, with [Note: frozen
parameters]), and its shards moved, cast or materialized after sharding (``group_moves.py``).

[Note: group buffers]
A group of ``P`` parameters over a shard group of ``N`` ranks keeps these buffers (``s_i`` is parameter
``i``'s padded shard size, ``G = sum(s_i)``, see [Note: dim-0 layout] in ``layout.py``):

- ``flat_shard`` (1D, ``G``, parameter dtype): this rank's padded shards, back to back. The sharded
  parameters the optimizer steps on are views of it, so the all-gather reads it without a copy-in. On the
  ``meta`` device for a unit built there, until ``to_empty`` (see ``materialize.py``).
- ``flat_full`` (1D, ``N * G``, compute dtype): one autograd leaf; parameter ``i`` owns the block
  ``[N * o_i, N * (o_i + s_i))`` holding its padded full tensor, and modules see views of that block.
  Its storage is freed (resized to 0) while the group is sharded. Being one leaf, it has one
  ``AccumulateGrad`` node: its post-accumulate hook fires exactly once per backward, when every
  parameter of the group has its gradient: that is the group's post-backward signal.
- transient: the all-gather output (``N * G``, rank-major) until it is copied into ``flat_full``; the
  reduce-scatter input (``N * G``) and output (``G``) until the reduction completes. The reduced output
  becomes the storage of the sharded gradients (views again, no copy).

Alive in each state (besides ``flat_shard`` and any sharded gradients):

- ``SHARDED``: nothing else.
- ``UNSHARDING``: the all-gather output, being filled.
- ``UNSHARDED``: ``flat_full``; modules see its views.

With one rank per shard group and no dtype cast (NO_SHARD), ``flat_full`` aliases ``flat_shard``:
unsharding is registering views, and resharding frees nothing.

[Note: packed and direct parameters]
Gathering all of a unit in one collective needs a copy-out from the rank-major all-gather output into
``flat_full``; on gloo that copy and gloo's throughput on very large buffers cost more than the latency
saved once a unit holds tens of MB (``benchmarks/train.py layout``). But a single parameter's padded full
block *is* rank-major: an all-gather of its padded shard lands directly in its ``flat_full`` block, and a
reduce-scatter reads its gradient block directly. So on gloo, parameters whose gathered size reaches
``DIRECT_MIN_BYTES`` are *direct*: laid out after the *packed* ones (a prefix of ``flat_shard`` and of the
gradient layout), and gathered and reduced one collective each, with no copy at all. The packed prefix
keeps one collective for all the small parameters (norms, biases), which would each cost gloo's latency.

[Note: mixed dtypes]
A unit may hold parameters of several dtypes when they are gathered in one compute dtype (``param_dtype`` set) and
its trainable parameters share one dtype: the usual LoRA setup, a frozen bf16 base with fp32 adapters, computing in
bf16. Each parameter's shard stays in its own dtype: ``flat_shard`` is then a buffer of *bytes*, the parameters
grouped by dtype (widest first within the packed ones and within the direct ones), each dtype's run of shards
starting on a 16-byte boundary (``ShardedParam.byte_offset``); ``local_view`` views a parameter's bytes as its
dtype. Everything else keeps the element layout (``ShardedParam.offset``) in one dtype: the gather's input is built
in ``param_dtype`` with one copy per run (``_send_buffer``; the frozen bf16 weights are copied as they are, never
upcast; a parameter gathered on its own that is in ``param_dtype`` already is sent from ``flat_shard`` with no copy,
``_send_pieces``), ``flat_full`` is in ``param_dtype``, and gradients are reduced in ``reduce_dtype`` and land in
the trainable parameters' dtype (``self.dtype``, the group's *main* dtype, which ``group_precision`` resolved): fp32
adapters keep fp32 weights, gradients and optimizer state. Full state dicts gather the bytes, so every parameter
comes back in its own dtype. Without ``param_dtype`` (gather each dtype as itself, as torch's FSDP2 does) a unit
would need one ``flat_full`` per dtype: refused, naming the two ways that work (``unit.build_unit``). Such a unit
moves after sharding (``to_empty`` from ``meta``, ``.to(device)``: each parameter keeps its dtype) but is not cast
(``model.to(dtype)`` is refused by name), and a parameter of another dtype than the gradients' made trainable after
sharding is refused at the next gather.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Shard

from fullshard.engine import collective_check, trace
from fullshard.engine.api import Offload
from fullshard.engine.collectives import (
    CommOptions,
    PendingReduce,
    all_gather_flat,
    copy_out,
    foreach_all_gather,
    full_block,
    wait_all,
)
from fullshard.engine.extension import ExtensionParams
from fullshard.engine.full_views import FullViews
from fullshard.engine.group_grads import GroupGrads
from fullshard.engine.group_moves import GroupMoves
from fullshard.engine.layout import ShardLayout, group_offsets
from fullshard.engine.materialize import storage_device_for
from fullshard.engine.mesh import ShardGroup, TPSpec, is_gloo
from fullshard.engine.param import ShardedParam, local_tensor, retire, set_owner
from fullshard.engine.precision import GroupPrecision, cast_to
from fullshard.engine.spare import SpareStorage
from fullshard.ranks import global_rank

__all__ = ["ParamGroup", "ShardState", "main_dtype"]


class ShardState(enum.Enum):
    """See [Note: group buffers] for what is alive in each state."""

    SHARDED = enum.auto()
    UNSHARDING = enum.auto()
    UNSHARDED = enum.auto()


class ParamGroup(GroupGrads, GroupMoves):
    """The parameters of one unit; see [Note: group buffers]."""

    def __init__(
        self,
        label: str,
        entries: list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter]],
        shard_group: ShardGroup,
        precision: GroupPrecision | None = None,
        *,
        use_dtensor: bool = False,
        offload: Offload | None = None,
        shard_dims: list[int] | None = None,
    ) -> None:
        """Shard ``entries`` (name, registrations, original parameter); the originals are retired. ``shard_dims``:
        per entry, the dim its shards split (default 0; see [Note: Shard(d)] in ``param.py``)."""
        self.label = label
        self.shard_group = shard_group
        self.device = shard_group.device  # where forward and backward compute
        self.offload = offload
        self.storage_device = storage_device_for(label, [(n, p) for n, _, p in entries], self.device, offload)
        dtypes = {p.dtype for _, _, p in entries}
        self.mixed = len(dtypes) > 1  # see [Note: mixed dtypes]
        if self.mixed and precision is None:
            names = ", ".join(f"{name}: {p.dtype}" for name, _, p in entries)
            raise ValueError(
                f"unit {label!r} mixes parameter dtypes ({names}) without a compute dtype. "
                "Cast the module to one dtype before wrapping, or wrap the differing submodules separately."
            )
        self.dtype = main_dtype([p for _, _, p in entries])
        self.precision = precision or GroupPrecision(self.dtype, self.dtype, self.dtype)
        world, rank = shard_group.shard_size, shard_group.shard_rank
        self.use_dtensor = use_dtensor
        dims = shard_dims or [0] * len(entries)
        self.params = [
            ShardedParam(
                name,
                regs,
                ShardLayout(tuple(local_tensor(p).movedim(d, 0).shape), world, rank),
                p.dtype,
                p.requires_grad,
                tp=self._tp_spec(name, p),
                shard_dim=d,
            )
            for (name, regs, p), d in zip(entries, dims)
        ]
        self.world = world
        # See [Note: packed and direct parameters]: small parameters first, gathered as one flat buffer.
        min_numel = DIRECT_MIN_BYTES // self.precision.param_dtype.itemsize
        is_direct = [
            world > 1 and world * sp.layout.padded_shard_numel >= min_numel and _gathers_directly(shard_group)
            for sp in self.params
        ]
        self.direct = [sp for sp, d in zip(self.params, is_direct) if d]
        self.packed = [sp for sp, d in zip(self.params, is_direct) if not d]
        # trainable parameters first (see [Note: frozen parameters] in group_grads.py), then one run of shards per
        # dtype (see [Note: mixed dtypes])
        self.packed = sorted(self.packed, key=lambda sp: (not sp.requires_grad, -sp.dtype.itemsize * self.mixed))
        self.direct = sorted(self.direct, key=lambda sp: (not sp.requires_grad, -sp.dtype.itemsize * self.mixed))
        ordered = self.packed + self.direct
        self.layout_order = ordered  # parameters by offset in flat_shard and flat_full
        for sp, offset in zip(ordered, group_offsets([sp.layout.padded_shard_numel for sp in ordered])):
            sp.offset = offset
        self.shard_numel = sum(sp.layout.padded_shard_numel for sp in self.params)  # G
        self._runs = _byte_runs(ordered) if self.mixed else []
        self.shard_nbytes = (
            self._runs[-1][1] + self._runs[-1][2] * self._runs[-1][3].itemsize if self._runs else 0
        )  # of a byte flat_shard
        self._grad_leaf: torch.Tensor | None = None  # see grad_full
        self._plan_grads()
        self.flat_shard = self._new_flat_shard()
        self._fill_shard([p for _, _, p in entries])
        self.alias_full = world == 1 and self.precision.param_dtype == self.dtype and offload is None and not self.mixed
        self._hooked: list[torch.Tensor] = []  # the leaves that carry the post-backward hook (see _track_grads)
        self._comm_hook: tuple[object, Callable[..., Any]] | None = None
        self.comm_options = CommOptions()  # FSDPModule's setters (see collectives.CommOptions)
        self._partial_reduce: torch.Tensor | None = None  # HSDP sums kept while requires_all_reduce is off
        self._on_grads_ready: Callable[[], None] | None = None  # see observe
        self.flat_full = self._new_flat_full()
        self._full_blocks: tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]] | None = None  # full_blocks
        self._packed_sizes = [sp.layout.padded_shard_numel for sp in self.packed]
        self.full_views_registered = False  # modules see views of flat_full (not the sharded parameters)
        self._stashed_grads: list[torch.Tensor | None] | None = None  # see expose_unsharded_grads
        self._unsynced_grad: torch.Tensor | None = None  # see hold_unsynced_grad
        self._state = ShardState.SHARDED
        self._on_state_change: Callable[[ShardState, ShardState], None] | None = None  # see observe
        self._summoned = False  # full-precision copies registered by summon_full_params
        self._gather: tuple[list[dist.Work], torch.Tensor | None] | None = None
        self._pending: list[tuple[PendingReduce, list[bool]]] = []  # with which parameters got a gradient
        self._unsharded_version = -1
        self._full_version = 0  # flat_full's version counter when a direct gather was issued
        self.spare: SpareStorage | None = None  # shared by the units of one root (see spare.py)
        self.extension: ExtensionParams | None = None  # gathered and freed with the group: see extension.py
        for sp, (_, _, original) in zip(self.params, entries):
            retire(original, sp.sharded_param)
            set_owner(sp.sharded_param, label)
            sp.register_sharded()

    # --- construction -------------------------------------------------------------------------------

    def _new_flat_shard(self) -> torch.Tensor:
        if self.mixed:
            flat = torch.zeros(self.shard_nbytes, dtype=torch.uint8, device=self.storage_device)
        else:
            flat = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.storage_device)
        if self.offload is not None and self.offload.pin_memory and torch.cuda.is_available() and not flat.is_meta:
            flat = flat.pin_memory()
        return flat

    def _tp_spec(self, name: str, param: nn.Parameter) -> TPSpec | None:
        """A tensor parallel parameter's spec (see [Note: tensor parallel parameters] in ``mesh.py``)."""
        if not isinstance(param, DTensor):
            tp_mesh = self.shard_group.tp_mesh
            return None if tp_mesh is None or not self.use_dtensor else self.shard_group.replicated_tp_spec(param, name)
        if not self.use_dtensor:
            raise ValueError(
                f"unit {self.label!r}: parameter {name!r} is a DTensor over mesh {param.device_mesh} "
                f"({param.placements}), e.g. from parallelize_module. FullyShardedDataParallel shards plain "
                "tensors only; combine tensor parallelism with fully_shard instead: "
                "fully_shard(block, mesh=mesh['dp']) for each block, then fully_shard(model, mesh=mesh['dp'])."
            )
        return self.shard_group.tp_spec(param, name)

    def _fill_shard(self, originals: list[nn.Parameter]) -> None:
        self.write_back([local_tensor(p) for p in originals])
        for sp in self.params:
            sp.sharded_param = nn.Parameter(self._as_sharded(sp, sp.local_view(self.flat_shard)), sp.requires_grad)

    def _as_sharded(self, sp: ShardedParam, local: torch.Tensor) -> torch.Tensor:  # plain, or a DTensor
        return self.dtensor_of(sp, local) if self.use_dtensor else local

    def dtensor_of(self, sp: ShardedParam, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's real rows of ``sp``, no copy) as a DTensor of ``sp``'s full shape, laid out as
        the sharded parameter is (the unit's mesh, or the dp and tp mesh for a tensor parallel parameter)."""
        return self.shard_group.dtensor(local, sp.shape, sp.tp, self.placements_of(sp))

    def placements_of(self, sp: ShardedParam) -> tuple[Placement, ...]:
        """How ``sp``'s sharded parameter lies on the unit's mesh (``Shard(sp.shard_dim)`` where it is sharded)."""
        placements = self.shard_group.placements()
        if sp.shard_dim == 0:
            return placements
        return tuple(Shard(sp.shard_dim) if isinstance(pl, Shard) else pl for pl in placements)

    def _new_flat_full(self) -> torch.Tensor:
        if self.alias_full:
            full = self.flat_shard.detach()
        else:
            full = torch.empty(self.world * self.shard_numel, dtype=self.precision.param_dtype, device=self.device)
            full.untyped_storage().resize_(0)
        self._hooked = []
        self._track_grads(full)
        return full

    def observe(
        self, on_grads_ready: Callable[[], None], on_state_change: Callable[[ShardState, ShardState], None]
    ) -> None:
        """Call ``on_grads_ready()`` once per backward when every parameter has its gradient (the unit's
        post-backward), and ``on_state_change(old, new)`` on every state change (the unit counts gathered units)."""
        self._on_grads_ready = on_grads_ready
        self._on_state_change = on_state_change

    def rename(self, label: str) -> None:
        """Name the unit by its path, once the root knows it: errors about its collectives say where."""
        self.label = label
        if self.extension is not None:
            self.extension.label = label

    @property
    def comm_hook(self) -> tuple[object, Callable[..., Any]] | None:
        return self._comm_hook

    def set_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Reduce gradients with ``hook(state, ...)`` from now on (see :func:`collectives.foreach_reduce`)."""
        self._comm_hook = (state, hook)

    @property
    def summoned(self) -> bool:
        """Full-precision copies are registered by ``summon_full_params`` (direct submodule calls are allowed)."""
        return self._summoned

    def set_summoned(self, summoned: bool) -> None:
        self._summoned = summoned

    def new_shard_storage(self, device: torch.device) -> None:
        """Allocate a new, zero ``flat_shard`` on ``device`` (and ``flat_full`` to go with it).

        Precondition: sharded. The caller makes the sharded parameters views of the new buffer.
        """
        if self.state is not ShardState.SHARDED:
            raise AssertionError(f"[rank {global_rank()}] {self.label}: new shard storage while gathered")
        self.storage_device = device
        self.flat_shard = self._new_flat_shard()
        self.flat_full = self._new_flat_full()
        self._unsharded_version = -1

    @property
    def state(self) -> ShardState:
        return self._state

    @state.setter
    def state(self, new: ShardState) -> None:
        old, self._state = self._state, new
        if self._on_state_change is not None and old is not new:
            self._on_state_change(old, new)

    # --- unshard / reshard --------------------------------------------------------------------------

    def unshard(self) -> None:
        """Start gathering the full parameters (no-op if they are gathered and still current); the gather is
        always asynchronous, and :meth:`wait_for_unshard` finishes it.

        Postcondition (after :meth:`wait_for_unshard`): state is ``UNSHARDED``, every registration
        resolves to a view of ``flat_full`` equal to the current shards.
        """
        if self.extension is not None:
            self.extension.unshard()
        if self.state is ShardState.UNSHARDING:
            return
        if self.state is ShardState.UNSHARDED:
            if self._unsharded_version == self.flat_shard._version:
                return
            self.state = ShardState.SHARDED  # the shards changed since the gather: gather again
        with trace.phase(trace.ALL_GATHER):
            if self.world == 1:
                self._gather = ([], None)
                if not self.alias_full:  # cast (or copy from the offload device) straight into flat_full
                    self._allocate_full()
                    copy_out(self._send_buffer() if self.mixed else self.flat_shard, [], [], self.flat_full)
            else:
                send, direct_sends = self._send_pieces()
                direct_blocks: list[torch.Tensor] = []
                if self.direct:  # gathered straight into flat_full (see collectives.foreach_all_gather)
                    self._allocate_full()
                    self._full_version = self.flat_full._version
                    direct_blocks = self.full_blocks()[1]
                self._gather = foreach_all_gather(
                    send,
                    self.packed,
                    self.direct,
                    direct_blocks,
                    self.flat_full,
                    self.world,
                    self.shard_group.shard_pg,
                    self.label,
                    self.comm_options.all_gather,
                    direct_sends,
                )
            self._unsharded_version = self.flat_shard._version
            self.state = ShardState.UNSHARDING

    def _send_pieces(self) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """What the all-gather sends: :meth:`_send_buffer`, or for a unit of mixed dtypes with direct parameters the
        packed prefix cast into one buffer and each direct parameter's padded shard on its own, a view of
        ``flat_shard``'s bytes where it is in ``param_dtype`` already. A frozen bf16 weight beside fp32 adapters
        (LoRA) is then sent from where it lies: no copy of the shard per gather, alive until the gather is waited
        for (a prefetched one's for a whole unit's compute)."""
        if not (self.mixed and self.direct):
            return self._send_buffer(), None
        direct_sends = []
        for sp in self.direct:
            nbytes = sp.layout.padded_shard_numel * sp.dtype.itemsize
            rows = self.flat_shard.narrow(0, sp.byte_offset, nbytes).view(sp.dtype)
            direct_sends.append(cast_to(rows, self.device, self.precision.param_dtype, non_blocking=True))
        return self._send_buffer(sum(self._packed_sizes)), direct_sends

    def _send_buffer(self, numel: int | None = None) -> torch.Tensor:
        """What the all-gather sends: ``flat_shard`` in ``param_dtype`` on the compute device (one copy per dtype
        for a unit of mixed dtypes, see [Note: mixed dtypes]); of a unit of mixed dtypes, only its first ``numel``
        elements when given."""
        param_dtype = self.precision.param_dtype
        if not self.mixed:
            return cast_to(self.flat_shard, self.device, param_dtype, non_blocking=True)
        numel = self.shard_numel if numel is None else numel
        send = torch.empty(numel, dtype=param_dtype, device=self.device)
        for offset, byte_offset, run_numel, dtype in self._runs:
            taken = min(run_numel, numel - offset)
            if taken > 0:
                rows = self.flat_shard.narrow(0, byte_offset, taken * dtype.itemsize).view(dtype)
                send.narrow(0, offset, taken).copy_(rows)
        return send

    def wait_for_unshard(self) -> None:
        """Finish a gather started by :meth:`unshard` and register the full parameters (again, after
        :meth:`expose_sharded`)."""
        if self.extension is not None:
            self.extension.wait()
        if self.state is ShardState.UNSHARDED and not self.full_views_registered:
            self._register_full_views()
        if self.state is not ShardState.UNSHARDING:
            return
        if self._gather is None:
            raise AssertionError(f"[rank {global_rank()}] {self.label}: UNSHARDING without a gather")
        works, gathered = self._gather
        self._gather = None
        wait_all(works, "all_gather", self.label, self.shard_group.shard_pg, trace.ALL_GATHER_WAIT)
        if works and self.direct:
            # gloo copies into a direct block with ATen ops on its own thread, bumping flat_full's version
            # counter whenever it finishes; put back the version autograd saw (see collectives.copy_out).
            torch._C._autograd._unsafe_set_version_counter((self.flat_full,), (self._full_version,))
        if not self.alias_full and gathered is not None:
            with trace.phase(trace.COPY_OUT):
                self._allocate_full()
                copy_out(gathered, self.full_blocks()[0], self._packed_sizes, self.flat_full)
        self._register_full_views()
        self.state = ShardState.UNSHARDED

    @property
    def full_nbytes(self) -> int:  # of the gathered parameters, flat_full
        return self.flat_full.numel() * self.flat_full.element_size()

    def full_blocks(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The gather's destinations in ``flat_full``: the packed parameters' full blocks viewed ``(world, s_i)``
        (for :func:`collectives.copy_out`), and the direct parameters' full blocks (1D).

        Built once per ``flat_full`` and kept: they would otherwise cost a ``narrow`` and a ``view`` per parameter
        at every gather, forward and backward. Kept views stay valid because ``flat_full`` keeps its storage object
        for its whole life: freeing resizes that storage to 0 bytes and gathering resizes it back (or swaps a spare
        buffer's memory into it, see ``spare.py``), neither of which touches the views' sizes, strides or offsets;
        only a new ``flat_full`` (``new_shard_storage``) makes new views. Precondition: ``flat_full`` is allocated
        (a view of a 0-byte storage fails its bounds check). The views are made without autograd (the gathers write
        them under ``no_grad``) and share ``flat_full``'s version counter.
        """
        cached = self._full_blocks
        if cached is None or cached[0] is not self.flat_full:
            with torch.no_grad():
                packed = [full_block(self.flat_full, sp, self.world).view(self.world, -1) for sp in self.packed]
                direct = [full_block(self.flat_full, sp, self.world) for sp in self.direct]
            cached = self._full_blocks = (self.flat_full, packed, direct)
        return cached[1], cached[2]

    def _allocate_full(self) -> None:
        storage = self.flat_full.untyped_storage()
        nbytes = self.full_nbytes
        if storage.size() != nbytes and not (self.spare is not None and self.spare.take(storage, nbytes)):
            storage.resize_(nbytes)

    def _register_full_views(self) -> None:
        # One autograd node for all of the group's views (see FullViews): its backward writes flat_full's whole
        # gradient at once.
        self.follow_requires_grad()
        with torch.enable_grad():
            views = FullViews.apply(self._leaf_for_grads(), self._full_views)
            for sp, view in zip(self.layout_order, views):
                sp.register(sp.compute_view(view if sp.requires_grad else view.detach()))
        if self._frozen_views:  # after the gradient's prefix: plain views, no autograd
            full = self.flat_full.detach()
            base = full.storage_offset()
            rest = self.layout_order[len(views) :]
            for sp, (shape, stride, offset) in zip(rest, self._frozen_views):
                sp.register(sp.compute_view(full.as_strided(shape, stride, base + offset)))
        self.full_views_registered = True

    def expose_sharded(self) -> None:
        """Register the sharded parameters while keeping the gathered ones for backward.

        After a forward that keeps its parameters gathered (the root, ``reshard_after_forward=False``) the
        module attributes would otherwise be non-leaf views: ``parameters()`` must keep yielding the leaf
        parameters the optimizer steps on. Autograd saved the views it needs; the next
        :meth:`wait_for_unshard` registers them again for compute.
        """
        for sp in self.params:
            sp.register_sharded()
        if self.extension is not None:
            self.extension.register_sharded()
        self.full_views_registered = False

    def reshard(self, keep_spare: bool = False) -> None:
        """Register the sharded parameters again and free the full ones.

        ``keep_spare``: the next unit to gather needs as many bytes: move the memory to it (see ``spare.py``).

        Postcondition: state is ``SHARDED``; ``flat_shard`` (and gradients) hold this group's memory.
        """
        if self.extension is not None:
            self.extension.reshard()
        if self.state is ShardState.SHARDED:
            return
        if self.state is ShardState.UNSHARDING:
            self.wait_for_unshard()
        with trace.phase(trace.RESHARD):
            self.expose_sharded()
            if not self.alias_full:
                storage = self.flat_full.untyped_storage()
                if keep_spare and self.spare is not None:
                    self.spare.keep(storage)
                else:
                    storage.resize_(0)
            self.state = ShardState.SHARDED

    def gather_full(self, source: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every parameter's gathered tensor (``gathered_shape``: its full tensor, or this rank's tp part of it)
        from ``source`` (default: ``flat_shard``), new storage."""
        source = (self.flat_shard if source is None else source).to(self.device)
        gathered = torch.empty(self.world * source.numel(), dtype=source.dtype, device=self.device)
        with collective_check.collective("all_gather", self.label, self.shard_group.shard_pg):
            all_gather_flat(gathered, source, self.shard_group.shard_pg, async_op=False)
        by_rank = gathered.view(self.world, source.numel())  # bytes for a unit of mixed dtypes: each its own
        return [sp.full_of(by_rank, self.world).clone() for sp in self.params]

    def sharded_grad_flat(self) -> torch.Tensor:
        """The sharded gradients in ``flat_shard``'s layout (zeros where a parameter has none)."""
        flat = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.storage_device)
        for sp in self.params:
            grad = sp.sharded_param.grad
            if grad is not None:
                sp.local_view(flat).copy_(local_tensor(grad))
        return flat

    def write_back(self, fulls: list[torch.Tensor]) -> None:
        """Copy this rank's rows of each gathered tensor (``gathered_shape``; a tp DTensor's local tensor is
        taken) into the shards."""
        with torch.no_grad():
            for sp, full in zip(self.params, fulls):
                sp.local_view(self.flat_shard).copy_(sp.rows_of(local_tensor(full).detach()).to(self.storage_device))


def main_dtype(params: list[nn.Parameter]) -> torch.dtype:
    """The dtype a group's gradients land in: its trainable parameters' (one dtype: see [Note: mixed dtypes]), or
    the first parameter's when none is trainable."""
    if not params:  # a unit of tensor-subclass parameters only (see extension.py)
        return torch.get_default_dtype()
    trainable = {p.dtype for p in params if p.requires_grad}
    if len(trainable) > 1:
        raise ValueError(
            f"trainable parameters of dtypes {sorted(map(str, trainable))} in one unit: a unit's trainable "
            "parameters share one dtype (their gradients land in one buffer). Cast them to one dtype, or wrap the "
            "differing submodules separately."
        )
    return trainable.pop() if trainable else params[0].dtype


def _byte_runs(ordered: list[ShardedParam]) -> list[tuple[int, int, int, torch.dtype]]:
    """Set each parameter's ``byte_offset`` in a byte flat shard and return the runs of one dtype, as
    ``(element offset, byte offset, numel, dtype)``: each run starts on a 16-byte boundary."""
    runs: list[tuple[int, int, int, torch.dtype]] = []
    end = 0
    for sp in ordered:
        if runs and runs[-1][3] == sp.dtype:
            offset, start, numel, dtype = runs[-1]
            sp.byte_offset = start + numel * dtype.itemsize
            runs[-1] = (offset, start, numel + sp.layout.padded_shard_numel, dtype)
        else:
            sp.byte_offset = -(-end // 16) * 16
            runs.append((sp.offset, sp.byte_offset, sp.layout.padded_shard_numel, sp.dtype))
        end = sp.byte_offset + sp.layout.padded_shard_numel * sp.dtype.itemsize
    return runs


DIRECT_MIN_BYTES = 4 * 2**20
"""A parameter whose gathered size reaches this is gathered (and reduced) on its own, in place."""


def _gathers_directly(shard_group: ShardGroup) -> bool:
    """Direct per-parameter collectives pay off on gloo (CPU), where the copy-out is dear and each call
    cheap relative to megabytes; on NCCL one flat collective per unit stays best."""
    return is_gloo(shard_group.shard_pg)

"""The collectives the engine issues, as free functions over flat buffers, with byte accounting.

Two layers. :func:`all_gather_flat`, :func:`reduce_scatter_flat` and :func:`all_reduce_flat` are the only
places a collective is issued. Above them, shaped like torch FSDP2's ``foreach_all_gather`` / ``foreach_reduce``,
what a parameter group runs over its buffers (it keeps the buffers and the state machine): the packed and
direct gathers and the copy-out (see [Note: packed and direct parameters] in ``group.py``), the rank-major
copy-in, reduce-scatter or all-reduce, communication hook, hybrid all-reduce and gradient division.

Every flat function skips the collective when its group has one rank (the result is the input) and records
in :data:`COMM_STATS` the bytes this rank sends (and as many receives) by the path that actually runs, so that
benchmarks can put the measured traffic next to the theoretical figure. For a group of ``n`` ranks and an
unsharded size of ``B`` bytes: an all-gather moves ``B (n-1)/n`` (a ring, and equally our pairwise exchange in
``p2p.py``); a reduce-scatter moves ``B (n-1)/n`` on NCCL's ring and on the pairwise exchange, but ``2 B
(n-1)/n`` on gloo's own path, which has no reduce-scatter and all-reduces the whole input instead (see
``p2p.py``); an all-reduce moves ``2 B (n-1)/n``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fullshard.engine import collective_check, p2p, trace
from fullshard.engine.mesh import ShardGroup, is_gloo
from fullshard.engine.param import ShardedParam

__all__ = [
    "COMM_STATS",
    "CommOptions",
    "CommStats",
    "PendingReduce",
    "all_gather_flat",
    "all_reduce_flat",
    "copy_out",
    "finish_reduce",
    "foreach_all_gather",
    "foreach_reduce",
    "full_block",
    "gradient_divide_factors",
    "predivide_factor",
    "reduce_scatter_flat",
    "wait_all",
]


@dataclass
class CommStats:
    """Bytes moved per kind of collective since the last :meth:`reset`, and how many were issued."""

    bytes: dict[str, int] = field(default_factory=lambda: {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0})
    calls: dict[str, int] = field(default_factory=lambda: {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0})

    wait_s: dict[str, float] = field(default_factory=lambda: {"all_gather": 0.0, "reduce_scatter": 0.0})

    def add_wait(self, kind: str, seconds: float) -> None:
        """Time the compute thread spent blocked waiting for a collective: communication not hidden."""
        self.wait_s[kind] += seconds

    def add(self, kind: str, nbytes: float) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    def reset(self) -> None:
        for kind in self.bytes:
            self.bytes[kind] = 0
            self.calls[kind] = 0
        for kind in self.wait_s:
            self.wait_s[kind] = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


COMM_STATS = CommStats()

# torch 2.13 renamed the flat collectives; older releases (2.11 on some GPU machines) have the old names only.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _size(pg: dist.ProcessGroup | None) -> int:
    return 1 if pg is None else dist.get_world_size(pg)


def all_gather_flat(
    output: torch.Tensor,
    shard: torch.Tensor,
    pg: dist.ProcessGroup | None,
    *,
    async_op: bool,
    tag: int | None = None,
) -> dist.Work | p2p.P2PWork | None:
    """``output`` (1D, ``n * shard.numel()``) receives every rank's ``shard`` (1D) in rank order.

    ``tag``: point-to-point on this tag, whatever the size (see ``collective_check.issue``)."""
    n = _size(pg)
    if n == 1:
        output.copy_(shard)
        return None
    COMM_STATS.add("all_gather", output.numel() * output.element_size() * (n - 1) / n)
    if tag is not None or p2p.use_p2p("all_gather", pg, output):
        work = p2p.pairwise_all_gather(output, shard, pg, p2p.ALL_GATHER_TAG if tag is None else tag)
        return _returned(work, async_op)
    return _all_gather_single(output, shard, group=pg, async_op=async_op)


def reduce_scatter_flat(
    output: torch.Tensor,
    full: torch.Tensor,
    pg: dist.ProcessGroup | None,
    *,
    async_op: bool,
    scratch_input: bool = False,
    tag: int | None = None,
) -> dist.Work | p2p.P2PWork | _ChunkOfAllReduce | None:
    """``output`` (1D) receives the sum over ranks of this rank's chunk of ``full`` (1D, ``n`` chunks).

    ``scratch_input``: the caller gives ``full`` up (its contents are undefined afterwards). On gloo, whose
    reduce-scatter clones its input, all-reduces the clone and copies one chunk out, ``full`` is then
    all-reduced in place instead: the same bytes on the wire as gloo's own (an all-reduce's) and the same sums
    bit for bit, without the full-size clone that would otherwise live as long as the returned work (see
    :class:`_ChunkOfAllReduce`).
    """
    n = _size(pg)
    if n == 1:
        output.copy_(full)
        return None
    ring_bytes = full.numel() * full.element_size() * (n - 1) / n
    if tag is not None or p2p.use_p2p("reduce_scatter", pg, full):
        COMM_STATS.add("reduce_scatter", ring_bytes)
        work = p2p.pairwise_reduce_scatter(output, full, pg, p2p.REDUCE_SCATTER_TAG if tag is None else tag)
        return _returned(work, async_op)
    # gloo's reduce_scatter_tensor and the in-place path below are both an all-reduce of all of ``full``.
    COMM_STATS.add("reduce_scatter", 2 * ring_bytes if is_gloo(pg) else ring_bytes)
    if scratch_input and is_gloo(pg):
        work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        return _returned(_ChunkOfAllReduce(work, full, output, dist.get_rank(pg), n), async_op)
    return _reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=pg, async_op=async_op)


def _returned(work: p2p.P2PWork | _ChunkOfAllReduce, async_op: bool) -> p2p.P2PWork | _ChunkOfAllReduce | None:
    """As torch's collectives: the handle when asynchronous, else done before returning."""
    if async_op:
        return work
    work.wait()
    return None


class _ChunkOfAllReduce:
    """A reduce-scatter done as an in-place all-reduce: ``wait()`` waits, then copies this rank's chunk.

    ``full`` is contiguous and 1D (as any all-reduce input), ``n`` chunks of ``output.numel()`` elements.
    Invariant: ``output`` holds the reduced chunk once ``wait()`` returns; the full buffer is released then.
    """

    def __init__(self, work: dist.Work, full: torch.Tensor, output: torch.Tensor, rank: int, n: int) -> None:
        self._work: dist.Work | None = work
        self._full: torch.Tensor | None = full
        self._output, self._rank, self._n = output, rank, n

    def wait(self) -> bool:
        if self._work is not None and self._full is not None:
            self._work.wait()
            # this rank's chunk, in one view op (``full`` is the contiguous 1D input, see reduce_scatter_flat)
            chunk = self._output.numel()
            self._output.copy_(self._full.as_strided((chunk,), (1,), self._full.storage_offset() + self._rank * chunk))
            self._work, self._full = None, None
        return True


def all_reduce_flat(tensor: torch.Tensor, pg: dist.ProcessGroup | None, *, async_op: bool) -> dist.Work | None:
    """Sum ``tensor`` over the ranks of ``pg`` in place."""
    n = _size(pg)
    if n == 1:
        return None
    COMM_STATS.add("all_reduce", 2 * tensor.numel() * tensor.element_size() * (n - 1) / n)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=pg, async_op=async_op)


# --- gradient division ----------------------------------------------------------------------------------


def gradient_divide_factors(
    data_parallel_size: int, reduce_dtype: torch.dtype, divide_factor: float | None = None
) -> tuple[float, float]:
    """``(before, after)``: what a gradient is divided by around its reduction, to average it over
    ``data_parallel_size`` ranks: before for float16 and bfloat16, whose sums can overflow; after otherwise. With
    ``divide_factor`` (``set_gradient_divide_factor``, see :class:`CommOptions`) the sum is divided by it, after."""
    if divide_factor is not None:
        return 1, divide_factor
    if data_parallel_size > 1 and reduce_dtype in (torch.float16, torch.bfloat16):
        return data_parallel_size, 1
    return 1, data_parallel_size


def predivide_factor(world: int) -> float:
    """The communication hooks' split: a power of two near ``sqrt(world)`` before, the rest after (torch's
    FSDP1 choice, restated), so that neither the terms nor the sum of a low-precision reduction overflow."""
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return float(factor) if world > 1 else 1.0


# --- the collectives of a parameter group -------------------------------------------------------------


def full_block(flat_full: torch.Tensor, sp: ShardedParam, world: int) -> torch.Tensor:
    """``sp``'s padded full block inside a buffer laid out like ``flat_full``: for ``sp`` alone, rank-major."""
    return flat_full.narrow(0, world * sp.offset, world * sp.layout.padded_shard_numel)


def _numel(params: Sequence[ShardedParam]) -> int:
    return sum(sp.layout.padded_shard_numel for sp in params)


def wait_all(works: list[dist.Work], kind: str, label: str, pg: dist.ProcessGroup | None, phase: str) -> None:
    """Wait for ``works``, counting the time blocked as exposed ``kind`` communication."""
    if not works:
        return
    start = time.perf_counter()
    with trace.phase(phase), collective_check.waiting(kind, label, pg):
        for work in works:
            work.wait()
    COMM_STATS.add_wait(kind, time.perf_counter() - start)


def foreach_all_gather(
    send: torch.Tensor,
    packed: list[ShardedParam],
    direct: list[ShardedParam],
    direct_blocks: list[torch.Tensor],
    flat_full: torch.Tensor,
    world: int,
    pg: dist.ProcessGroup | None,
    label: str,
    custom: Any = None,
    direct_sends: list[torch.Tensor] | None = None,
) -> tuple[list[dist.Work], torch.Tensor | None]:
    """Start gathering a group from ``send`` (its flat shard, compute dtype), asynchronously: the packed prefix
    in one collective into a new rank-major buffer (returned, for :func:`copy_out`), each direct parameter straight
    into its block of ``flat_full`` (``direct_blocks``, views of its allocated storage; its version counter
    preserved, see :func:`copy_out`). ``direct_sends``: the direct parameters' padded shards, one tensor each, where
    ``send`` holds only the packed prefix (a unit of mixed dtypes, ``ParamGroup._send_pieces``)."""
    out = None
    if packed:
        numel = _numel(packed)
        out = torch.empty(world * numel, dtype=send.dtype, device=flat_full.device)
    gather = all_gather_flat if custom is None else _custom_gather(custom)

    def post(tag: int | None) -> list[Any]:
        works = []
        if packed:
            numel = _numel(packed)
            shard = send if numel == send.numel() else send.narrow(0, 0, numel)  # no direct ones: all of it
            works.append(gather(out, shard, pg, async_op=True, tag=tag))
        if direct:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(flat_full):
                shards = direct_sends or [send.narrow(0, sp.offset, sp.layout.padded_shard_numel) for sp in direct]
                for shard, block in zip(shards, direct_blocks):
                    works.append(gather(block, shard, pg, async_op=True, tag=tag))
        return works

    if custom is not None:  # the user's collective: issued here, after a blocking check
        with collective_check.collective("all_gather", label, pg):
            return [w for w in post(None) if w is not None], out
    return collective_check.issue("all_gather", label, pg, post), out


def _custom_gather(comm: Any) -> Callable[..., Any]:
    """A user's ``AllGather`` (``set_custom_all_gather``) in :func:`all_gather_flat`'s signature."""

    def gather(
        output: torch.Tensor, shard: torch.Tensor, pg: dist.ProcessGroup | None, *, async_op: bool, tag: int | None
    ) -> Any:
        return comm(output, shard, pg, async_op=async_op)

    return gather


def copy_out(gathered: torch.Tensor, blocks: list[torch.Tensor], sizes: list[int], flat_full: torch.Tensor) -> None:
    """Move the packed parameters' rank-major pieces of ``gathered`` into their ``flat_full`` blocks: one
    ``split_with_sizes_copy`` into ``blocks``, the packed parameters' full blocks of ``flat_full`` viewed
    ``(world, s_i)`` (``s_i`` = ``sizes[i]``, their padded shard sizes; the views are the group's, kept from step to
    step, see ``ParamGroup.full_blocks``).

    With one rank, ``gathered`` is the flat shard itself (any dtype and device) and ``blocks`` is empty: it is
    cast into ``flat_full`` in one copy, asynchronous from pinned memory.

    The copy must not bump the version counter: autograd saved views of ``flat_full`` in forward and checks
    the counter in backward, and this write restores exactly the data they saw.
    """
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(flat_full):
        if not blocks:
            flat_full.copy_(gathered, non_blocking=True)
            return
        torch.split_with_sizes_copy(gathered.view(len(blocks[0]), -1), sizes, dim=1, out=blocks)


def rank_major(grad: torch.Tensor, params: list[ShardedParam], world: int) -> torch.Tensor:
    """``params``' padded blocks of ``grad`` (in layout order) reordered rank-major: ``(world, their G)``.

    One ``as_strided`` per parameter straight to its ``(world, s_i)`` block (not a ``narrow`` and a ``view``: this
    runs for every parameter at every backward), then one ``cat``.
    """
    numel = _numel(params)
    if world == 1 and numel == grad.numel():
        return grad.view(1, -1)  # all of the group's parameters, and one rank: already in order
    out = torch.empty(world, numel, dtype=grad.dtype, device=grad.device)
    if params:
        grad = grad if grad.is_contiguous() else grad.contiguous()
        base = grad.storage_offset()
        with trace.phase(trace.COPY_IN):
            blocks = []
            for sp in params:
                size = sp.layout.padded_shard_numel
                blocks.append(grad.as_strided((world, size), (size, 1), base + world * sp.offset))
            torch.cat(blocks, dim=1, out=out)
    return out


@dataclass
class CommOptions:
    """What ``FSDPModule``'s setters change about one group's collectives (torch FSDP2's names), all numerics:

    - ``divide_factor`` (``set_gradient_divide_factor``): the reduced gradient is the sum over data parallel ranks
      divided by this, instead of by their number.
    - ``force_sum`` (``set_force_sum_reduction_for_comms``): sums are always reduced here (gloo has no average);
      it decides only what ``all_reduce_hook`` sees: the undivided sum (on), or the average (off, as torch's ``AVG``).
    - ``all_reduce_hook`` (``set_all_reduce_hook``): called with the reduced shard after the reduce-scatter (and after
      the all-reduce across replicas under HSDP); it may change it in place.
    - ``requires_all_reduce`` (``set_requires_all_reduce``, HSDP): off, the reduce-scatter outputs are summed locally
      and the all-reduce across replicas (and ``.grad``) waits for the next backward that has it on.
    - ``reduce_scatter`` / ``all_gather`` (``set_custom_reduce_scatter`` / ``set_custom_all_gather``): objects with
      torch's ``ReduceScatter`` / ``AllGather`` call signatures, used for the unit's collectives over its shard group.
    """

    divide_factor: float | None = None
    force_sum: bool = False
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    requires_all_reduce: bool = True
    reduce_scatter: Any = None
    all_gather: Any = None


@dataclass
class PendingReduce:
    """A started reduction of one group's gradients, for :func:`finish_reduce`."""

    works: list[dist.Work]
    output: torch.Tensor  # 1D, the trainable parameters' padded shards, reduce dtype
    keep_alive: object  # the reduce-scatter inputs, until the works complete
    divide_after: float  # what is left of the average (see gradient_divide_factors); hooks average themselves
    hooked: bool = False


def foreach_reduce(
    grad: torch.Tensor,
    packed: list[ShardedParam],
    direct: list[ShardedParam],
    shard_group: ShardGroup,
    label: str,
    comm_hook: tuple[object, Callable[..., Any]] | None,
    options: CommOptions | None = None,
) -> PendingReduce:
    """Start reducing ``grad`` (the flat unsharded gradient, reduce dtype, ours to overwrite) to this rank's
    shard of the trainable parameters ``packed + direct`` (layout order).

    Without a hook: one asynchronous reduce-scatter for the packed ones (after a rank-major copy-in), one per
    direct parameter straight from its block; with one rank per shard group, an all-reduce across replicas.
    A communication hook runs synchronously, as torch's FSDP runs it, and averages itself."""
    world = shard_group.shard_size
    params = packed + direct
    numel = _numel(params)
    pg = shard_group.reduce_pg
    if comm_hook is not None:
        state, hook = comm_hook
        ordered = rank_major(grad, params, world)
        with collective_check.collective("reduce_scatter", label, pg):
            if world == 1:
                output = ordered.view(-1)
                hook(state, output)
            else:
                output = torch.empty(numel, dtype=grad.dtype, device=grad.device)
                hook(state, ordered.view(-1), output)
        return PendingReduce([], output, None, 1, hooked=True)
    options = options or CommOptions()
    before, after = gradient_divide_factors(shard_group.data_parallel_size, grad.dtype, options.divide_factor)
    if before > 1:
        grad.div_(before)
    if world == 1:
        output = rank_major(grad, params, world).view(-1)
        with collective_check.collective("reduce_scatter", label, pg):
            work = all_reduce_flat(output, pg, async_op=True)
        return PendingReduce([work] if work is not None else [], output, None, after)
    if options.reduce_scatter is not None:  # one call of the user's reduce-scatter for the whole group
        ordered = rank_major(grad, params, world)
        output = options.reduce_scatter.allocate((numel,), dtype=grad.dtype, device=grad.device)
        with collective_check.collective("reduce_scatter", label, pg):
            work = options.reduce_scatter(output, ordered.view(-1), pg, dist.ReduceOp.SUM, async_op=False)
        return PendingReduce([work] if work is not None else [], output, (ordered, grad), after)
    ordered = rank_major(grad, packed, world)  # (N, packed G)
    output = torch.empty(numel, dtype=grad.dtype, device=grad.device)
    packed_numel = _numel(packed)

    def post(tag: int | None) -> list[Any]:
        # ``ordered`` and ``grad`` are ours to clobber (the caller handed the gradient over): on gloo that saves a
        # full-size clone per reduction (see reduce_scatter_flat's scratch_input).
        works = []
        if packed_numel:
            packed_out = output if packed_numel == numel else output.narrow(0, 0, packed_numel)
            works.append(
                reduce_scatter_flat(packed_out, ordered.view(-1), pg, async_op=True, scratch_input=True, tag=tag)
            )
        for sp in direct:
            # A direct parameter's gradient block is already rank-major: reduce it in place, no copy-in.
            out = output.narrow(0, sp.grad_offset, sp.layout.padded_shard_numel)
            block = full_block(grad, sp, world)
            works.append(reduce_scatter_flat(out, block, pg, async_op=True, scratch_input=True, tag=tag))
        return works

    return PendingReduce(collective_check.issue("reduce_scatter", label, pg, post), output, (ordered, grad), after)


def finish_reduce(
    pending: PendingReduce,
    shard_group: ShardGroup,
    label: str,
    options: CommOptions | None = None,
    partial: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Wait for ``pending``, all-reduce across replicas (hybrid sharding), run the all-reduce hook and average:
    the reduced output. ``partial``: reduce-scatter sums kept from backwards that skipped the all-reduce, added
    first. Returns ``None`` when ``options.requires_all_reduce`` is off under HSDP: the caller keeps
    ``pending.output`` (undivided) as its partial sum."""
    options = options or CommOptions()
    wait_all(pending.works, "reduce_scatter", label, shard_group.shard_pg, trace.REDUCE_WAIT)
    output = pending.output
    replicate_pg = shard_group.replicate_pg
    if shard_group.shard_size > 1 and replicate_pg is not None and not pending.hooked:
        if partial is not None:
            output.add_(partial)
        if not options.requires_all_reduce:
            return None
        with trace.phase(trace.REDUCE_WAIT), collective_check.collective("all_reduce", label, replicate_pg):
            all_reduce_flat(output, replicate_pg, async_op=False)
    hook = None if pending.hooked else options.all_reduce_hook
    if hook is not None and options.force_sum:
        hook(output)  # sees the sum, as torch's SUM reductions show it
        hook = None
    if pending.divide_after != 1:
        output.div_(pending.divide_after)
    if hook is not None:
        hook(output)  # sees the average, as torch's AVG reductions show it
    return output

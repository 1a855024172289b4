"""World-size-invariant training: the weights after every step are bitwise the same on 1, 2, 4, ...
ranks for a fixed global batch and seed. Opt-in: ``invariant_micro_batches=G`` on ``fully_shard`` and
``FullyShardedDataParallel``, or ``FULLSHARD_INVARIANT_MICRO_BATCHES=G`` in the environment.

[Note: world-size invariance]
Floating-point addition is not associative, so a gradient summed over the same samples in a different order
differs in the last bits; by default the order depends on the number of ranks ``N`` (what each rank adds
locally, and the order of gloo's or NCCL's reduction). Invariant mode fixes every order independently of ``N``:

- The global batch is cut into ``G`` micro-batches, ``G`` a power of two and a multiple of ``N`` (refused
  otherwise, by name). Micro-batch ``g`` holds the same samples whatever ``N``. The rank at data-parallel index
  ``i`` (its rank in the shard group for FULL_SHARD and SHARD_GRAD_OP; ``replica * shard_size + shard_rank``
  for hybrid sharding) runs micro-batches ``i*G/N .. (i+1)*G/N - 1`` in order, one forward and backward each
  (the training loop does this); the engine accumulates them: every unit's gradient is reduced once per
  ``G/N`` backward passes, on the last of them, with no ``no_sync()`` needed (a ``no_sync()`` around the
  first ``G/N - 1`` is accepted; one around the last is refused, it would leave the step unreduced).
- Gradients are summed over the ``G`` micro-batches in one pairwise tree: within a rank each micro-batch's
  unsharded gradient is pushed onto a binary-counter stack of partial sums (:class:`TreeSum`), so the rank's
  ``G/N`` micro-batches make exactly one subtree; across ranks, an all-to-all hands every rank the ``N``
  partial sums of its chunk, added in the same tree (pairs of neighbouring ranks first). Hybrid sharding does
  this over the shard group, then all-gathers the ``R`` replicas' chunks and adds them in the same tree (shard
  groups are consecutive ranks, so this is the global tree over ``N = S*R`` ranks). The average divides by
  ``N`` as the default does: the loss divided by ``G/N`` and the sum divided by ``N`` are powers of two, which
  scale every rounding exactly (outside the subnormal range).
- The gradient norm for ``clip_grad_norm_`` is summed over fixed pieces of ``PIECE`` elements of every
  parameter's flattened full gradient (not over whatever shard a rank holds): each piece is summed, in a fixed
  pairwise tree, by the rank holding its first element, which receives the few elements it lacks from the
  ranks after it (one all-reduce of a buffer in which every element is nonzero on one rank only: adding zeros
  is exact); the piece sums travel the same way, and every rank adds them in one fixed tree. The pieces are
  summed in float32 whatever the gradients' dtype.
- Precision: float32 and bfloat16 (:data:`DTYPES`), as parameters (``model.to(torch.bfloat16)``) or as a mixed
  precision ``param_dtype``. Every partial sum of the tree is float32 (:data:`PARTIAL_SUM_DTYPE`), whatever the
  ``reduce_dtype``: a micro-batch's bf16 gradient is widened when pushed (exact), and the step's sum is rounded
  once, where it lands in the sharded gradient's dtype (the parameters', or ``reduce_dtype`` with
  ``keep_low_precision_grads``): one rounding at one fixed point, none for float32 gradients. The partial sums
  cannot cross ranks in bf16: a rank's partial sum covers ``G/N`` micro-batches, so rounding it for the wire would
  round at a level of the tree that depends on ``N``. (Rounding to bf16 after every addition of the tree would be
  invariant too, with ``log2(G)`` roundings; float32 is the more accurate of the two.) So ``reduce_dtype`` does not
  change the result here (``keep_low_precision_grads`` aside): ``bfloat16`` gives float32's bits, more accurate
  than the default mode's bf16 reduce-scatter, at twice its bytes (a float16 ``reduce_dtype``, which would only
  round the gradients to float16 where they land, is refused with the others). float16 compute is refused: the
  scaling argument above needs float32's exponent range, which bf16 shares, but float16's subnormals (below
  ``6e-5``) and overflow (above ``65504``) lie where gradients live, so a micro-batch's gradient scaled by
  ``1/(G/N)`` rounds differently on different ``N`` (and a grad scaler skips different steps). A loss divided by
  ``G`` on every rank, summed without the division by ``N``, would lift that; not done.

What this costs: each rank keeps up to ``log2(G/N) + 1`` unsharded gradients of a unit between micro-batches, in
float32 (the default's sharded accumulation keeps none; ``no_sync()`` keeps one, in the compute dtype), an
all-to-all instead of a reduce-scatter (the same bytes for float32, twice a bf16 ``reduce_dtype``'s; on gloo the
pairwise reduce-scatter overlaps better), and the tree additions. Forward and backward kernels must themselves be
deterministic and shape-stable (the same micro-batch shape on every ``N``, the same intra-op thread count; on CUDA
``torch.use_deterministic_algorithms(True)``), which this module cannot enforce.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.engine import collective_check, trace
from fullshard.engine.collectives import COMM_STATS, all_gather_flat, rank_major
from fullshard.engine.group import ParamGroup
from fullshard.engine.names import STATE_ATTR
from fullshard.engine.param import local_tensor

__all__ = [
    "total_norm",
    "DTYPES",
    "ENV",
    "PARTIAL_SUM_DTYPE",
    "PIECE",
    "TreeSum",
    "check_one_mode",
    "check_ready_to_clip",
    "fold_backward",
    "fold_leftovers",
    "invariant_micro_batches",
    "invariant_per_rank",
    "micro_batches_per_rank",
    "pending_micro_batches",
    "restore_step_in_progress",
    "step_in_progress",
    "resolve",
    "tree_sum_rows",
    "validate_group",
]

ENV = "FULLSHARD_INVARIANT_MICRO_BATCHES"
"""The environment's ``G`` when the entry point's ``invariant_micro_batches`` is not given (unset, empty or 0: off)."""

DTYPES = (torch.float32, torch.bfloat16)
"""Parameter, compute, reduce and gradient dtypes invariant mode takes (see [Note: world-size invariance])."""

PARTIAL_SUM_DTYPE = torch.float32
"""The dtype of every partial sum of the tree, whatever the parameter and reduce dtypes: a micro-batch's gradient
is widened to it (exactly) when pushed, and the step's sum is rounded once, into the sharded gradient's dtype."""

PIECE = 1024
"""Elements per piece of a flattened full gradient in the invariant gradient norm (a power of two; fixed, so
that the norm is the same function of the gradients on every world size and in every release)."""


def resolve(micro_batches: int | None, where: str) -> int | None:
    """``G`` from the argument, else from :data:`ENV`; ``None`` for the default mode. Refuses a ``G`` that is not
    a power of two."""
    value: Any = micro_batches
    source = f"{where}(invariant_micro_batches={micro_batches!r})"
    if value is None:
        text = os.environ.get(ENV, "").strip()
        if text in ("", "0"):
            return None
        source = f"{ENV}={text!r}"
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{source}: expected the number of micro-batches per step, a power of two.") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(
            f"{source}: world-size-invariant mode needs the number G of micro-batches per step to be a power of "
            "two (1, 2, 4, 8, ...), a multiple of every world size it will run on."
        )
    return value


def micro_batches_per_rank(micro_batches: int, data_parallel_size: int) -> int:
    """``G/N``: the micro-batches each of ``N = data_parallel_size`` ranks runs per optimizer step, when the step is
    ``G = micro_batches`` of them. The one place that divides; the entry points and the front end refuse a ``G``
    that ``N`` does not divide before they get here, each in its own words."""
    if data_parallel_size < 1 or micro_batches % data_parallel_size:
        raise ValueError(
            f"invariant_micro_batches={micro_batches} is not a multiple of the data-parallel size {data_parallel_size}."
        )
    return micro_batches // data_parallel_size


def validate_group(group: ParamGroup, micro_batches: int, where: str) -> None:
    """Refuse what invariant mode does not cover, naming it: a ``G`` that the data-parallel size does not divide,
    dtypes other than float32 and bfloat16 (float16 for the reason given in [Note: world-size invariance]), tensor
    parallel parameters."""
    n = group.shard_group.data_parallel_size
    if micro_batches % n:
        raise ValueError(
            f"{where}: invariant_micro_batches={micro_batches} is not a multiple of the data-parallel size {n}. "
            f"Each rank runs G/N micro-batches per step, so G must be a multiple of every world size (powers of two)."
        )
    precision = group.precision
    dtypes = {
        "the parameters' dtype": group.dtype,
        "param_dtype": precision.param_dtype,
        "reduce_dtype": precision.reduce_dtype,
        "the gradients' dtype": precision.grad_dtype,
    }
    bad = [f"{name} {dtype}" for name, dtype in dtypes.items() if dtype not in DTYPES]
    if torch.float16 in (group.dtype, precision.param_dtype):  # the forward and backward compute in float16
        raise ValueError(
            f"{where}: world-size-invariant mode refuses float16 compute (got {', '.join(bad)}): each rank divides "
            "its loss by G/N, and float16's narrow exponent range turns that exact power-of-two scaling into "
            "different roundings on different world sizes (subnormal gradients, overflows that make a grad scaler "
            "skip different steps). Use torch.bfloat16 instead, which has float32's range: MixedPrecision(param_dtype="
            "torch.bfloat16), MixedPrecisionPolicy(param_dtype=torch.bfloat16) or model.to(torch.bfloat16); or drop "
            "invariant_micro_batches."
        )
    if bad:
        raise ValueError(
            f"{where}: world-size-invariant mode supports float32 and bfloat16 only (got {', '.join(bad)}); cast the "
            "model to torch.float32 or torch.bfloat16 before sharding and take one of them for param_dtype and "
            "reduce_dtype (the tree sums in float32 whatever reduce_dtype says), or drop invariant_micro_batches."
        )
    if any(sp.tp is not None for sp in group.params):
        raise ValueError(f"{where}: world-size-invariant mode does not support tensor parallel parameters yet.")


def check_one_mode(states: Sequence[Any]) -> None:
    """At the root's lazy init: every unit of one model runs in the same mode (the same ``G``, or none)."""
    modes = {s.config.invariant_micro_batches for s in states}
    if len(modes) > 1:
        labels = {mode: next(s.label for s in states if s.config.invariant_micro_batches == mode) for mode in modes}
        shown = ", ".join(f"{labels[m]!r}: {m}" for m in sorted(modes, key=str))
        raise ValueError(
            f"the units of one model mix world-size-invariant modes (invariant_micro_batches per unit: {shown}); pass "
            "the same invariant_micro_batches to every fully_shard call (FullyShardedDataParallel passes it on)."
        )


# --- the tree ---------------------------------------------------------------------------------------------


@dataclass
class TreeSum:
    """A binary-counter stack of partial sums: pushing ``2**k`` tensors leaves one entry, their pairwise tree sum
    ``((t0 + t1) + (t2 + t3)) + ...``; entries are ``(level, sum of 2**level consecutive pushes)``.

    The pushed tensors become the stack's (they are added into in place).
    """

    entries: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    count: int = 0

    def push(self, tensor: torch.Tensor) -> None:
        level = 0
        while self.entries and self.entries[-1][0] == level:
            _, left = self.entries.pop()
            tensor = left.add_(tensor)  # left + right, in place: the same bits as a new tensor
            level += 1
        self.entries.append((level, tensor))
        self.count += 1

    def take(self) -> torch.Tensor:
        """The sum of every push (their number must be a power of two); the stack is empty afterwards."""
        if len(self.entries) != 1:
            raise AssertionError(f"TreeSum.take after {self.count} pushes: not a power of two")
        total = self.entries.pop()[1]
        self.count = 0
        return total


def tree_sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """The pairwise tree sum of the rows of ``rows`` (``(n, m)``, ``n`` a power of two): rows ``2i`` and ``2i+1``
    first, as :class:`TreeSum` adds consecutive pushes."""
    while rows.shape[0] > 1:
        rows = rows[0::2] + rows[1::2]
    return rows[0]


def _tree_sum_columns(values: torch.Tensor) -> torch.Tensor:
    """Each row of ``values`` (``(k, w)``, ``w`` a power of two) summed in a fixed pairwise tree: ``(k,)``."""
    while values.shape[1] > 1:
        half = values.shape[1] // 2
        values = values[:, :half] + values[:, half:]
    return values[:, 0]


# --- accumulation and reduction ------------------------------------------------------------------------------

_TREES: weakref.WeakKeyDictionary[ParamGroup, TreeSum] = weakref.WeakKeyDictionary()


def _tree(group: ParamGroup) -> TreeSum:
    tree = _TREES.get(group)
    if tree is None:
        tree = _TREES[group] = TreeSum()
    return tree


def _folded(group: ParamGroup) -> int:
    """Micro-batches folded into ``group``'s stack and not reduced yet (0 right after a step's last one)."""
    tree = _TREES.get(group)
    return 0 if tree is None else tree.count


# --- a sharded model in invariant mode, as other packages see it: plain values ---------------------------------


def _units(module: nn.Module) -> list[Any]:
    """The ``UnitState``s in ``module``'s tree, pre-order, each once: ``state.unit_states_in`` (``state`` imports
    this module, so it cannot be imported here)."""
    states = [s for m in module.modules() if (s := m.__dict__.get(STATE_ATTR)) is not None]
    return list({id(s): s for s in states}.values())


def invariant_micro_batches(module: nn.Module) -> int | None:
    """``G`` of ``module`` when it is sharded in world-size-invariant mode (every unit in it has
    ``invariant_micro_batches``); ``None`` in the default mode or when nothing in it is sharded."""
    modes = [s.config.invariant_micro_batches for s in _units(module)]
    return modes[0] if modes and None not in modes else None


def invariant_per_rank(module: nn.Module) -> int | None:
    """``G/N`` of ``module`` in world-size-invariant mode: micro-batches per rank and optimizer step, ``N`` its
    units' data-parallel size; ``None`` in the default mode or when no unit of it holds parameters."""
    if invariant_micro_batches(module) is None:
        return None
    return next((_per_rank(s) for s in _units(module) if s.group is not None), None)


def _per_rank(state: Any) -> int:
    return micro_batches_per_rank(state.config.invariant_micro_batches, state.group.shard_group.data_parallel_size)


def pending_micro_batches(module: nn.Module) -> int:
    """Micro-batches of the step in progress folded by ``module``'s units and not reduced yet (the most any unit
    holds; 0 at a step boundary and in the default mode)."""
    return max((_folded(s.group) for s in _units(module) if s.group is not None), default=0)


def step_in_progress(module: nn.Module) -> list[dict[str, Any]] | None:
    """The partial sums of a step part-way through (micro-batches folded, not reduced yet), one entry per unit of
    ``module`` in order: ``{"unit", "count", "levels", "sums"}`` (``unit``: the module's class name; the sums copied
    to the CPU); ``None`` when no unit has a micro-batch pending (a step boundary). What ``save_state`` writes
    mid-step: the sums are this rank's unsharded ones, so only the same world size can go on from them."""
    states = _units(module)
    if not any(s.group is not None and _folded(s.group) for s in states):
        return None
    saved = []
    for state in states:
        tree = _TREES.get(state.group) if state.group is not None else None
        entries = tree.entries if tree is not None else []
        saved.append({"unit": state.class_name, "count": 0 if tree is None else tree.count,
                      "levels": [level for level, _ in entries],
                      "sums": [t.detach().to("cpu", copy=True) for _, t in entries]})  # fmt: skip
    return saved


def restore_step_in_progress(module: nn.Module, saved: list[dict[str, Any]] | None, where: str) -> None:
    """Put back what :func:`step_in_progress` returned (``None``: a step boundary, every unit's stack emptied) into
    the same units on the same world size: the next backward passes finish the step as the saving run did."""
    states = _units(module)
    for i, state in enumerate(states):
        group: ParamGroup | None = state.group
        entry = saved[i] if saved is not None and i < len(saved) else {"count": 0, "levels": [], "sums": []}
        unsharded = 0 if group is None else group.world * group.shard_numel
        if saved is not None and (
            len(saved) != len(states)
            or entry["unit"] != state.class_name
            or any(t.numel() != unsharded for t in entry["sums"])
        ):
            units = [(e["unit"], [t.numel() for t in e["sums"]]) for e in saved]
            raise ValueError(
                f"{where}: the step in progress was saved for the units (class, partial sum sizes) {units}; this "
                f"model's unit {i} is {state.class_name!r} of {unsharded} elements. Load it into the model that "
                "saved it, wrapped the same way, on the same number of processes."
            )
        if group is None:
            continue
        tree = _tree(group)
        tree.count = int(entry["count"])
        tree.entries = [(int(level), t.to(group.device, PARTIAL_SUM_DTYPE))
                        for level, t in zip(entry["levels"], entry["sums"], strict=True)]  # fmt: skip


def fold_backward(state: Any) -> None:
    """A unit's post-backward in invariant mode: push this micro-batch's unsharded gradient (zeros if it has none)
    and, on the rank's ``G/N``-th micro-batch, reduce the step (see [Note: world-size invariance]).

    ``state`` is the unit's ``UnitState``; its ``reduced`` flag marks the unit as folded for this backward."""
    group: ParamGroup = state.group
    if state.reduced or not group.requires_grad:
        return
    state.reduced = True
    tree = _tree(group)
    per_rank = _per_rank(state)
    last = tree.count + 1 == per_rank
    if last and not state.requires_gradient_sync:
        raise RuntimeError(
            f"unit {group.label!r}: micro-batch {per_rank} of {per_rank} on this rank ran with gradient sync off "
            f"(no_sync() or set_requires_gradient_sync(False)); in world-size-invariant mode the engine reduces "
            f"every G/N = {per_rank} micro-batches itself. Run exactly G/N micro-batches per step, the last one with "
            "gradient sync on (or never turn it off)."
        )
    tree.push(group.take_unsharded_grad(PARTIAL_SUM_DTYPE))  # bf16 -> float32 is exact
    if last:
        _reduce(group, tree.take())


def fold_leftovers(states: Sequence[Any]) -> None:
    """The root's final callback in invariant mode: fold (zeros, or a gradient the post-backward did not see) for
    every unit that was not folded in this backward, so every unit counts every micro-batch."""
    for state in states:
        if state.group is not None:
            fold_backward(state)


def _reduce(group: ParamGroup, total: torch.Tensor) -> None:
    """Reduce this rank's subtree sum ``total`` (unsharded, laid out like ``flat_full``) to its shard in the tree
    order, average it and add it into the sharded gradients."""
    if group.comm_hook is not None:
        raise ValueError(
            f"unit {group.label!r}: a communication hook is registered; world-size-invariant mode reduces in its "
            "own fixed order and takes no hook."
        )
    sg = group.shard_group
    world = group.world
    with trace.phase(trace.REDUCE_SCATTER):
        ordered = rank_major(total, group.grad_params, world)  # (S, trainable G)
        if world > 1:
            received = torch.empty_like(ordered)
            pg = sg.shard_pg
            COMM_STATS.add("reduce_scatter", ordered.numel() * ordered.element_size() * (world - 1) / world)
            with collective_check.collective("reduce_scatter", group.label, pg):
                dist.all_to_all_single(received, ordered, group=pg)
            chunk = tree_sum_rows(received)  # row r: rank r's partial sum of this rank's chunk
        else:
            chunk = ordered.view(-1)
        replicate_pg = sg.replicate_pg
        if replicate_pg is not None:
            replicas = sg.replicate_size
            gathered = torch.empty(replicas, chunk.numel(), dtype=chunk.dtype, device=chunk.device)
            with collective_check.collective("all_gather", group.label, replicate_pg):
                all_gather_flat(gathered.view(-1), chunk.contiguous(), replicate_pg, async_op=False)
            chunk = tree_sum_rows(gathered)
        n = sg.data_parallel_size
        if n > 1:
            chunk = chunk / n  # a power of two: exact
    # The one rounding of the step's sum (float32 partial sums; none for float32 gradients), at a fixed point.
    group.accumulate_sharded_grads(chunk.to(group.storage_device, group.precision.grad_dtype))


# --- the gradient norm ----------------------------------------------------------------------------------------


@dataclass
class _Param:
    """One trainable parameter as the norm sees it: its flattened full gradient's ``numel``, each shard rank's
    ``[start, end)`` of it (none when every rank holds all of it: a parameter outside every unit, or a unit with one
    rank per shard group), and this rank's local gradient."""

    numel: int
    ranges: list[tuple[int, int]]
    local: torch.Tensor  # flattened; ``ranges`` empty: the whole gradient, held by every rank


def _ceil_to(value: int, step: int) -> int:
    return -(-value // step) * step


def _head(start: int, end: int) -> tuple[int, int]:
    """The part of ``[start, end)`` that belongs to a piece starting before ``start``."""
    return start, min(end, _ceil_to(start, PIECE))


def check_ready_to_clip(states: Sequence[Any]) -> None:
    """Refuse to clip while a unit has micro-batches folded but not reduced (their gradients are not there yet), or
    when units are sharded over different process groups (the fixed pieces assume one)."""
    groups: list[ParamGroup] = [s.group for s in states if s.group is not None]
    for group in groups:
        if _folded(group):
            raise RuntimeError(
                f"clip_grad_norm_ with {_folded(group)} micro-batches of unit {group.label!r} folded "
                "but not reduced yet: in world-size-invariant mode run G/N micro-batches per rank before clipping."
            )
    _shard_pg(groups)


def _shard_pg(groups: list[ParamGroup]) -> dist.ProcessGroup | None:
    """The one process group every sharded unit of ``groups`` shards over (``None``: nothing is sharded)."""
    shard_pgs = {id(g.shard_group.shard_pg): g.shard_group.shard_pg for g in groups if g.shard_group.shard_size > 1}
    if len(shard_pgs) > 1:
        raise ValueError("world-size-invariant clip_grad_norm_ needs every unit sharded over the same process group.")
    return next(iter(shard_pgs.values()), None)


def total_norm(states: Sequence[Any], other_params: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The total ``norm_type``-norm (finite ``norm_type``) of the gradients of ``states`` and ``other_params``, the
    same bitwise on every world size (see [Note: world-size invariance]); ``grad_norm.clip_grad_norm_`` clips with it.
    """
    groups: list[ParamGroup] = [s.group for s in states if s.group is not None]
    pg = _shard_pg(groups)
    shard_rank = dist.get_rank(pg) if pg is not None else 0
    params: list[_Param] = []
    devices: list[torch.device] = []  # of the gradients, in order: the first is where the sums are made
    for group in groups:
        for sp in group.params:
            if not sp.requires_grad:
                continue
            lay = sp.layout
            grad = sp.sharded_param.grad
            if grad is None:
                flat = torch.zeros(lay.local_numel, device=group.storage_device)
            else:
                flat = local_tensor(grad).detach().reshape(-1)
                devices.append(flat.device)
            ranges = []  # none: held whole by every rank (one rank per shard group, e.g. NO_SHARD)
            for r in range(lay.world if lay.world > 1 else 0):
                rl = lay.for_rank(r)
                start = rl.row_offset * rl.row_numel
                ranges.append((start, start + rl.local_numel))
            params.append(_Param(lay.numel, ranges, flat))
    for p in other_params:
        if p.grad is not None:
            params.append(_Param(p.numel(), [], local_tensor(p.grad).detach().reshape(-1)))
            devices.append(p.grad.device)
    device = devices[0] if devices else torch.device("cpu")
    piece_sums = _piece_sums(params, pg, shard_rank, norm_type, device)
    width = 1 << max(0, (piece_sums.numel() - 1).bit_length())
    padded = torch.zeros(1, width, dtype=torch.float32, device=device)
    padded[0, : piece_sums.numel()] = piece_sums
    return _tree_sum_columns(padded)[0].pow(1.0 / norm_type)


def _powered(values: torch.Tensor, norm_type: float) -> torch.Tensor:
    values = values.float()
    return values * values if norm_type == 2.0 else values.abs().pow(norm_type)


def _piece_sums(
    params: list[_Param], pg: dist.ProcessGroup | None, shard_rank: int, norm_type: float, device: torch.device
) -> torch.Tensor:
    """Every piece's sum of ``|g|^p``, in the fixed order (parameters in unit order, pieces in element order),
    equal on every rank."""
    # 1. The boundary elements: each rank's head (the part of its range in a piece that starts on an earlier rank),
    # laid out parameter by parameter, rank by rank, exchanged by one all-reduce (nonzero on one rank each).
    head_offsets: list[list[int]] = []
    size = 0
    for p in params:
        offsets = []
        for start, end in p.ranges:
            offsets.append(size)
            lo, hi = _head(start, end)
            size += hi - lo
        head_offsets.append(offsets)
    heads = torch.zeros(size, dtype=torch.float32, device=device)
    for p, offsets in zip(params, head_offsets):
        if p.ranges:
            start, end = p.ranges[shard_rank]
            lo, hi = _head(start, end)
            heads[offsets[shard_rank] : offsets[shard_rank] + hi - lo] = p.local[: hi - lo].float()
    if pg is not None and size:
        with collective_check.collective("all_reduce", "clip_grad_norm_", pg):
            dist.all_reduce(heads, group=pg)
    # 2. Each rank sums the pieces that start in its range; the piece sums travel the same way.
    first_piece: list[int] = []
    count = 0
    for p in params:
        first_piece.append(count)
        count += -(-p.numel // PIECE)
    sums = torch.zeros(count, dtype=torch.float32, device=device)
    shared = torch.zeros(count, dtype=torch.bool, device=device)
    for p, offsets, first in zip(params, head_offsets, first_piece):
        if not p.ranges:  # held whole by every rank: summed everywhere, kept out of the exchange
            values, begin = p.local, 0
            shared[first : first + -(-p.numel // PIECE)] = True
        else:
            start, end = p.ranges[shard_rank]
            begin = _ceil_to(start, PIECE)
            if begin >= end:
                continue  # no piece starts here
            stop = min(p.numel, _ceil_to(end, PIECE))
            own = p.local[begin - start :]
            if stop > end:  # the heads of the ranks after this one, which are contiguous in the buffer
                after = offsets[shard_rank + 1]
                values = torch.cat([own.float(), heads[after : after + stop - end]])
            else:
                values = own
        n_pieces = -(-values.numel() // PIECE)
        block = torch.zeros(n_pieces * PIECE, dtype=torch.float32, device=device)
        block[: values.numel()] = _powered(values, norm_type)
        index = first + begin // PIECE
        sums[index : index + n_pieces] = _tree_sum_columns(block.view(n_pieces, PIECE))
    if pg is not None and count:
        exchanged = torch.where(shared, torch.zeros_like(sums), sums)
        with collective_check.collective("all_reduce", "clip_grad_norm_", pg):
            dist.all_reduce(exchanged, group=pg)
        sums = torch.where(shared, sums, exchanged)
    return sums

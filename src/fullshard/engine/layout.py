"""Shard math for one parameter: how its dim 0 is split across the ranks of a shard group.

Pure functions of shapes and ranks (ints in, ints out); no tensors and no process group.

[Note: dim-0 layout]
A parameter of shape ``(d0, *rest)`` is split on dim 0 the way ``torch.chunk`` splits it, which is also
``DTensor``'s ``Shard(0)``: every rank owns ``rows_per_rank = ceil(d0 / world)`` padded rows, rank ``r``
holds the real rows ``[r * rows_per_rank, min((r + 1) * rows_per_rank, d0))`` (possibly none), and the rest
of its rows are padding. Concatenating the padded shards of all ranks in rank order gives a tensor of
``world * rows_per_rank`` rows whose first ``d0`` rows are the parameter. So an all-gather of padded shards
rebuilds the parameter with one narrow, and a reduce-scatter of a padded gradient hands each rank exactly
the gradient of its rows. A 0-dim parameter is treated as shape ``(1,)``.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardLayout:
    """Where one rank's shard of a parameter lies. All sizes are element counts.

    The derived sizes are computed once per layout (``cached_property``): the gather, reduce and gradient paths
    read them for every parameter of every unit at every step.
    """

    shape: tuple[int, ...]
    world: int
    rank: int

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"ShardLayout(world={self.world}, rank={self.rank}): need 0 <= rank < world.")

    @functools.cached_property
    def dim0(self) -> int:
        return self.shape[0] if self.shape else 1

    @functools.cached_property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @functools.cached_property
    def rows_per_rank(self) -> int:
        return -(-self.dim0 // self.world)

    @functools.cached_property
    def padded_shard_numel(self) -> int:
        """Elements every rank stores for this parameter, padding included (equal on all ranks)."""
        return self.rows_per_rank * self.row_numel

    @functools.cached_property
    def local_rows(self) -> int:
        """Real (non-padding) rows this rank holds."""
        return max(0, min(self.rows_per_rank, self.dim0 - self.rank * self.rows_per_rank))

    @functools.cached_property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel

    @functools.cached_property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this rank's real rows: ``(local_rows, *rest)``."""
        return (self.local_rows, *self.shape[1:]) if self.shape else (self.local_rows,)

    @functools.cached_property
    def local_stride(self) -> tuple[int, ...]:
        """Contiguous strides of ``local_shape`` (as ``torch.empty(local_shape).stride()``)."""
        return contiguous_strides(self.local_shape)

    @functools.cached_property
    def row_offset(self) -> int:
        """First global row this rank holds (``dim0`` when it holds none)."""
        return min(self.rank * self.rows_per_rank, self.dim0)

    @functools.cached_property
    def numel(self) -> int:
        return self.dim0 * self.row_numel

    def for_rank(self, rank: int) -> ShardLayout:
        return ShardLayout(self.shape, self.world, rank)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``torch.empty(shape).stride()``, without a tensor."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def group_offsets(padded_numels: list[int]) -> list[int]:
    """Offsets of consecutive parameters in a group's flat shard, in the order given."""
    return list(itertools.accumulate(padded_numels[:-1], initial=0)) if padded_numels else []

"""Who steps which parameter whole (see [Note: whole-parameter steps] in ``whole_step.py``): the optimizer's sharded
parameters as :class:`Entry`s, grouped by shard group into :class:`Bucket`s, and each one's owner.

Invariant: owners depend on global shapes only (:func:`plan_owners` over :func:`newton_schulz_cost` for Muon, over
elements otherwise), so every rank, every tp rank of a tensor parallel parameter included, computes the same owners
without a collective. ``benchmarks/simulate.py`` plans with the same function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Bucket", "Entry", "assign_owners", "is_muon", "newton_schulz_cost", "plan_owners"]


@dataclass
class Entry:
    """A sharded parameter of the optimizer, stepped whole on ``owner`` (a rank of its shard group)."""

    param: nn.Parameter
    fqn: str
    sp: Any  # the engine's ShardedParam: its layout, rows_of
    owner: int = 0
    whole: nn.Parameter | None = None  # on the owner, during the step


@dataclass
class Bucket:
    """The entries of one shard group."""

    pg: dist.ProcessGroup | None
    world: int
    rank: int
    entries: list[Entry] = field(default_factory=list)
    stepping: list[Entry] = field(default_factory=list)  # those with a gradient, in this step
    pipelined: bool = False  # this step's exchange is pipelined (whole_pipeline.py)
    scatters: list[Any] = field(default_factory=list)  # posted scatters the post-hook finishes


def plan_owners(costs: list[int], world: int) -> list[int]:
    """The owner of each of parameters costing ``costs`` (elements, or :func:`newton_schulz_cost`) among ``world``
    ranks: costliest first, each to the rank with the least cost so far (ties: lowest rank).
    ``benchmarks/simulate.py`` plans with it too."""
    load = [0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def newton_schulz_cost(shape: tuple[int, ...]) -> int:
    """What Muon's step costs on a matrix of ``shape``, up to a constant: ``m * n * min(m, n)`` (its Newton-Schulz
    products); elements for a parameter that is not 2-D."""
    numel = math.prod(shape)
    return numel * min(shape) if len(shape) == 2 else numel


def is_muon(optimizer: torch.optim.Optimizer) -> bool:
    muon = getattr(torch.optim, "Muon", None)
    return muon is not None and isinstance(optimizer, muon)


def assign_owners(bucket: Bucket, cost: Any) -> None:
    # global shapes: a tensor parallel parameter's tp part may differ in size across tp ranks (uneven splits),
    # and the ranks of a tp group must agree on the owners (they gather over tp together)
    owners = plan_owners([cost(tuple(e.sp.shape)) for e in bucket.entries], bucket.world)
    for e, owner in zip(bucket.entries, owners, strict=True):
        e.owner = owner

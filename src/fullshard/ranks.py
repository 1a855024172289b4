"""Which rank this process is, and what the ranks agree on: torch-only helpers that every layer may import.

The engine, ``checkpoint/`` and the front end all ask the same questions of ``torch.distributed``: this
process's rank (0 without a process group), every rank's value of something, and "do all ranks agree?"
before work that would hang or diverge if they did not. This module answers them once. It imports torch
only, so ``checkpoint/`` (which must not import the engine) and the engine share it.

[Note: rank agreement]
Each check is one ``all_gather_object`` of (this rank's value, this rank's problem). Every rank then sees
every rank's value and raises the same error, naming the first rank that failed or that disagrees with rank
0 (and how), so no rank goes on into a collective the others never reach. Without a process group, or with
one rank, nothing is communicated and every check passes (a problem is still raised).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = [
    "RanksDisagreeError",
    "first_difference",
    "PEER_LOST",
    "gather_from_ranks",
    "global_rank",
    "peer_lost",
    "rank_and_world",
    "require_agreement",
    "warn_rank0",
]


PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")
"""What torch's and gloo's errors say when another rank's process ended or its connection broke."""


def peer_lost(exc: BaseException | str) -> bool:
    """``exc`` (an error or its text) says that a collective failed because a peer went away."""
    text = str(exc).lower()
    return any(pattern in text for pattern in PEER_LOST)


def global_rank() -> int:
    """This process's rank in the default group (0 without one): the rank messages and rank-0 choices use."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rank_and_world(process_group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """This process's rank in ``process_group`` and its size: ``(0, 1)`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def warn_rank0(message: str, stacklevel: int = 2) -> None:
    """``warnings.warn(message)`` on rank 0 (or without a process group), so that N ranks do not print the same
    line N times; a no-op on other ranks."""
    if global_rank() != 0:
        return
    warnings.warn(message, stacklevel=stacklevel + 1)


class RanksDisagreeError(ValueError, RuntimeError):
    """Ranks hold different values where they must hold the same one.

    Both a ``ValueError`` (the ranks were given different inputs) and a ``RuntimeError`` (what torch raises when
    ranks fall out of step), so that callers catching either keep working.
    """


def gather_from_ranks(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value``, in rank order; a collective over ``group`` (just ``[value]`` with one rank)."""
    if rank_and_world(group)[1] == 1:
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def require_agreement(
    value: Any,
    *,
    what: str,
    remedy: str,
    problem: str | None = None,
    describe: Callable[[int, Any, Any], str] | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[Any]:
    """Raise on every rank unless no rank has a ``problem`` and every rank's ``value`` equals rank 0's.

    ``what`` names the check (it starts every message). A rank's ``problem`` (a message, e.g. what it could not
    initialise) is raised on every rank as a ``ValueError``: ``"{what}: on rank {r}, {problem}"``. Otherwise a
    differing value raises :class:`RanksDisagreeError`: ``"{what}: {detail}. {remedy}"``, where ``detail`` is
    ``describe(rank, theirs, rank0s)`` for the first differing rank (default: both values in full) and names
    the other differing ranks too. Returns every rank's value. A collective: see [Note: rank agreement].
    """
    everyone = gather_from_ranks((value, problem), group)
    failed = [(rank, theirs) for rank, (_, theirs) in enumerate(everyone) if theirs]
    if failed:
        rank, first = failed[0]
        more = f" (ranks {', '.join(str(r) for r, _ in failed)} failed)" if len(failed) > 1 else ""
        raise ValueError(f"{what}: on rank {rank}, {first}{more}")
    values = [v for v, _ in everyone]
    differing = [rank for rank, theirs in enumerate(values) if theirs != values[0]]
    if differing:
        rank = differing[0]
        detail = (
            describe(rank, values[rank], values[0])
            if describe is not None
            else f"rank {rank} has {values[rank]!r}, but rank 0 has {values[0]!r}"
        )
        more = f" (ranks {', '.join(map(str, differing))} all differ from rank 0)" if len(differing) > 1 else ""
        raise RanksDisagreeError(f"{what}: {detail}{more}. {remedy.rstrip('.')}.")
    return values


def first_difference(ours: list[Any], theirs: list[Any], missing: Any = None) -> tuple[int, Any, Any]:
    """The first index where two different lists differ, with each one's item there (``missing`` past its end)."""
    i = next(
        i for i in range(max(len(ours), len(theirs))) if i >= len(ours) or i >= len(theirs) or ours[i] != theirs[i]
    )
    return i, ours[i] if i < len(ours) else missing, theirs[i] if i < len(theirs) else missing

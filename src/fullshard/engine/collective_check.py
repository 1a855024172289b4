"""Name the unit and the collective when ranks fall out of step, instead of a bare timeout or a hang.

[Note: desynchronised ranks]
Every rank must issue the engine's collectives in one order: the same units, forward and backward, the same
number of times. When one rank runs one forward more, or units in another order, its collective meets a
different one on the other ranks, or none, and gloo waits for the process group's timeout (fullshard sets
minutes, see ``frontend/runtime.py``). Two aids:

- Always: an error raised while issuing or waiting for a collective is re-raised naming this rank, the
  collective, the unit and how many forwards this process ran (:func:`collective`), so a timeout says where.
- With ``FULLSHARD_DEBUG=1`` (or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``): before each collective, all ranks of
  its group exchange what they are about to do (kind, unit, how many collectives the group ran) and every rank
  raises naming the first rank that differs. The exchange is itself a collective, so it costs one
  ``all_gather_object`` per collective: a debug mode, not for training runs.

Invariant: nothing here changes what is communicated; with the debug mode off the cost is one context
manager per collective.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator

import torch.distributed as dist

from fullshard.ranks import gather_from_ranks, global_rank

__all__ = ["DesyncError", "collective", "debug_enabled", "note_forward", "waiting"]


class DesyncError(RuntimeError):
    """Ranks are about to run different collectives (or one of them timed out waiting for the others)."""


def debug_enabled() -> bool:
    """``FULLSHARD_DEBUG`` set to anything but ``0``, or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""
    return os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL" or os.environ.get(
        "FULLSHARD_DEBUG", ""
    ) not in ("", "0")


_forwards = 0  # root forwards this process ran: shown in messages to place the error in training
_issued: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()  # per group, compared


def note_forward() -> None:
    """Called by the root unit at the start of each forward."""
    global _forwards
    _forwards += 1


def _where(kind: str, label: str, pg: dist.ProcessGroup | None) -> str:
    count = _issued.get(pg, 0) if pg is not None else 0
    return f"{kind} of unit {label!r} (collective #{count} of its group)"


def _size(pg: dist.ProcessGroup | None) -> int:
    return 1 if pg is None or not dist.is_initialized() else dist.get_world_size(pg)


@contextlib.contextmanager
def collective(kind: str, label: str, pg: dist.ProcessGroup | None) -> Iterator[None]:
    """Around issuing a collective of ``kind`` for unit ``label``: counted, compared across ranks in debug
    mode, and its errors named; see the module note."""
    if _size(pg) == 1:
        yield
        return
    if pg is not None:
        _issued[pg] = _issued.get(pg, 0) + 1
    where = _where(kind, label, pg)
    if debug_enabled():
        _compare_across_ranks(where, pg)
    with _named(f"{where}, in forward #{_forwards} of this process"):
        yield


@contextlib.contextmanager
def waiting(kind: str, label: str, pg: dist.ProcessGroup | None) -> Iterator[None]:
    """Around waiting for an issued collective: its errors (a timeout) named; nothing is counted."""
    if _size(pg) == 1:
        yield
        return
    with _named(f"waiting for the {_where(kind, label, pg)}, in forward #{_forwards} of this process"):
        yield


@contextlib.contextmanager
def _named(where: str) -> Iterator[None]:
    try:
        yield
    except DesyncError:
        raise
    except RuntimeError as exc:
        raise DesyncError(
            f"[rank {global_rank()}] {where} failed: {exc}\nIf this is a timeout, the other ranks did not "
            "reach the same collective: they ran a different number of forwards or units in another order, "
            "finished early, or hang. Run with FULLSHARD_DEBUG=1 to name the first rank that differs."
        ) from exc


def _compare_across_ranks(where: str, pg: dist.ProcessGroup | None) -> None:
    try:
        everyone = gather_from_ranks(where, pg)
    except RuntimeError as exc:
        raise DesyncError(
            f"[rank {global_rank()}] FULLSHARD_DEBUG: about to run {where}, but the other ranks did not reach "
            f"any engine collective ({exc}). They ran fewer forwards, finished early, or wait elsewhere."
        ) from exc
    ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(len(everyone)))
    differing = [(rank, other) for rank, other in zip(ranks, everyone) if other != where]
    if differing:
        rank, other = differing[0]
        listing = "; ".join(f"rank {r}: {w}" for r, w in zip(ranks, everyone))
        raise DesyncError(
            f"[rank {global_rank()}] FULLSHARD_DEBUG: ranks are out of step. This rank (in forward #{_forwards}) "
            f"is about to run {where}, rank {rank} {other}. All: {listing}. Every rank must run the same forwards "
            "and backwards, with units in one order."
        )

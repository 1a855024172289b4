"""Name the unit and the collective when ranks fall out of step, instead of a bare timeout, a hang or an abort.

[Note: desynchronised ranks]
Every rank must issue the engine's collectives in one order: the same units, forward and backward, the same
number of times. When one rank runs one forward more, or units in another order, its collective meets a
different one on the other ranks, or none. If the two have different sizes, gloo aborts the process from its
I/O thread ("Received data size doesn't match expected size", SIGABRT, nothing Python can catch); if they
have the same size, the ranks exchange wrong bytes silently; with no partner at all, gloo waits for the
process group's timeout (fullshard sets minutes, see ``frontend/processes/runtime.py``). Three aids:

- Always: an error raised while issuing or waiting for a collective is re-raised naming this rank, the
  collective, the unit and how many forwards this process ran (:func:`collective`), so a timeout says where.
  A peer that ended or whose connection broke raises :class:`PeerLostError`, not :class:`DesyncError`.
- By default on gloo groups: a header before each of the engine's collectives. The ranks all-gather four
  integers (the kind of collective, a CRC-32 of the unit's name, how many collectives the group ran, how many
  forwards this process ran), the same 32 bytes on every rank whatever comes next, so the exchange itself
  cannot meet a collective of another size. Every rank compares the kinds and units and raises
  :class:`DesyncError` naming each rank's collective, unit and counts before any payload moves. Cost: one small blocking
  collective per engine collective (a group's gather, its reduction), measured in ``docs/benchmarks.md``.
  ``FULLSHARD_CHECK_COLLECTIVES=0`` turns it off. Not on NCCL and other device backends: reading the header
  back would synchronise the device on every collective.
- With ``FULLSHARD_DEBUG=1`` (or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``), on every backend: the same comparison
  with the full descriptions (``all_gather_object``, a pickle and two collectives each time).

Invariant: nothing here changes what is communicated by the engine's own collectives; what a mismatch cannot
be caught against is a collective outside the engine (the script's own ``all_reduce``, a barrier): the
header then meets it as any collective would.
"""

from __future__ import annotations

import array
import contextlib
import os
import weakref
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from fullshard.engine.mesh import is_gloo
from fullshard.ranks import gather_from_ranks, global_rank, peer_lost

__all__ = [
    "CHECK_VAR",
    "DesyncError",
    "PeerLostError",
    "check_enabled",
    "collective",
    "debug_enabled",
    "note_forward",
    "waiting",
]

CHECK_VAR = "FULLSHARD_CHECK_COLLECTIVES"


class DesyncError(RuntimeError):
    """Ranks are about to run different collectives (or one of them timed out waiting for the others)."""


class PeerLostError(RuntimeError):
    """A collective failed because another rank's process ended or its connection broke."""


def debug_enabled() -> bool:
    """``FULLSHARD_DEBUG`` set to anything but ``0``, or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""
    return os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL" or os.environ.get(
        "FULLSHARD_DEBUG", ""
    ) not in ("", "0")


def check_enabled(pg: dist.ProcessGroup | None) -> bool:
    """Whether the header goes before each collective over ``pg``: gloo, unless ``FULLSHARD_CHECK_COLLECTIVES=0``."""
    value = os.environ.get(CHECK_VAR, "1").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{CHECK_VAR}={value!r}: expected 1 (check each collective, the default) or 0 (do not)")
    return value != "0" and is_gloo(pg)


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
    """Around issuing a collective of ``kind`` for unit ``label``: counted, compared across ranks first (the
    header on gloo, the full descriptions in debug mode), and its errors named; see the module note."""
    if _size(pg) == 1:
        yield
        return
    if pg is not None:
        _issued[pg] = _issued.get(pg, 0) + 1
    where = _where(kind, label, pg)
    if debug_enabled():
        _compare_across_ranks(where, pg)
    elif check_enabled(pg):
        _compare_headers(kind, label, pg)
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
    except (DesyncError, PeerLostError):
        raise
    except RuntimeError as exc:
        if peer_lost(exc):
            raise PeerLostError(
                f"[rank {global_rank()}] a peer process ended or its connection was lost during the {where}: {exc}"
            ) from exc
        raise DesyncError(
            f"[rank {global_rank()}] {where} failed: {exc}\nIf this is a timeout, the other ranks did not "
            "reach the same collective: they ran a different number of forwards or units in another order, "
            "finished early, wait in a collective outside fullshard, or hang."
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


# --- the header (see the module note) ----------------------------------------------------------------------

_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# torch 2.13 renamed the flat all-gather; older releases have the old name only (as in collectives.py).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_label_of_crc: dict[int, str] = {}  # every unit name seen here: the other ranks' CRCs are named back with it


def _header(kind: str, label: str, pg: dist.ProcessGroup) -> array.array:
    crc = zlib.crc32(label.encode())
    _label_of_crc.setdefault(crc, label)
    return array.array("q", [_KINDS.index(kind), crc, _issued.get(pg, 0), _forwards])


def _describe(header: list[int]) -> str:
    kind, crc, count, forwards = header
    label = _label_of_crc.get(crc, f"<CRC-32 {crc:#010x}>")
    return f"{_KINDS[kind]} of unit {label!r} (collective #{count} of its group) in its forward #{forwards}"


def _compare_headers(kind: str, label: str, pg: dist.ProcessGroup | None) -> None:
    """All-gather this rank's header over ``pg``; raise on every rank if any rank is about to run another kind
    of collective or another unit's. The counts are only reported: a forward without collectives (NO_SHARD)
    is no desync, and a process that caught an earlier error on one rank would never run in step again."""
    if pg is None:
        return
    # The header's buffers are Python arrays seen as tensors (``torch.frombuffer``, no copy): building and reading
    # them dispatches no ATen op, so the check costs the collective alone (it runs before every engine collective).
    mine = _header(kind, label, pg)
    n, width = dist.get_world_size(pg), len(mine)
    everyone = array.array("q", bytes(n * width * mine.itemsize))
    with _named(f"check before the {_where(kind, label, pg)}, in forward #{_forwards} of this process"):
        _all_gather_single(
            torch.frombuffer(everyone, dtype=torch.int64), torch.frombuffer(mine, dtype=torch.int64), group=pg
        )
    headers = [everyone[r * width : (r + 1) * width].tolist() for r in range(n)]
    if all(h[:2] == headers[0][:2] for h in headers):
        return
    ranks = dist.get_process_group_ranks(pg)
    me = dist.get_rank(pg)
    others = [(r, h) for r, h in zip(ranks, headers) if h[:2] != headers[me][:2]]
    rank, other = others[0]
    listing = "; ".join(f"rank {r}: {_describe(h)}" for r, h in zip(ranks, headers))
    raise DesyncError(
        f"[rank {global_rank()}] ranks are out of step: this rank is about to run {_describe(headers[me])}, "
        f"rank {rank} {_describe(other)}." + (f" All: {listing}." if n > 2 else "") + " Every rank must run "
        f"the same forwards and backwards, with units in one order (caught before the collective ran; {CHECK_VAR}=0 "
        "turns this check off)."
    )

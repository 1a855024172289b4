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
- By default on gloo groups: a header with each of the engine's collectives. Every rank sends every other
  rank four integers (the kind of collective, a CRC-32 of the unit's name, how many collectives the group ran,
  how many forwards this process ran), the same 32 bytes whatever comes next, point-to-point on a tag of their
  own (:data:`HEADER_TAG`), in the order the collectives are issued. Every rank compares the kinds and units
  and raises :class:`DesyncError` naming each rank's collective, unit and counts. Where the comparison happens
  is [Note: the check off the critical path]. ``FULLSHARD_CHECK_COLLECTIVES=0`` turns it off. Not on NCCL and
  other device backends: reading the header back would synchronise the device on every collective.
- With ``FULLSHARD_DEBUG=1`` (or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``), on every backend: the same comparison
  with the full descriptions (``all_gather_object``, a pickle and two collectives each time).

Invariants: under the check the engine's gathers and reductions take the point-to-point path of ``p2p.py``: the
same gathers on any number of ranks and the same sums on 2; on 3 or more its sums add in rank order, which may
differ from gloo's own collective in the last bit (``FULLSHARD_CHECK_COLLECTIVES=0`` below the crossover sizes
of ``p2p.py``). What a mismatch
cannot be caught against is a collective outside the engine (the script's own ``all_reduce``, a barrier): the
headers travel point-to-point and never meet it, so the rank in the script's collective and the rank waiting
for a header both wait for the group's timeout, which names where. After a :class:`DesyncError` the mismatched
collectives stay posted: the job is over.
"""

from __future__ import annotations

import array
import collections
import contextlib
import os
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import Any

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
    "issue",
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
#
# [Note: the check off the critical path]
# A header exchanged and compared before its collective is posted makes the ranks meet at every collective: each
# waits for the slowest at every gather and reduction it issues, where without the check it would post the
# collective and go on computing (measured: 10-16% of a small model's step). So the comparison waits for the
# collective's result instead. What makes that safe is what gloo aborts on: a message of another size arriving
# for a posted receive. Hence:
# - The asynchronous collectives (a unit's gather, its tensor-subclass parameters' gather, its gradients'
#   reduction: :func:`issue`) go point-to-point
#   (``p2p.py``) on a tag drawn from their kind and unit (:func:`payload_tag`), posted at once after the header.
#   Messages match only on the same tag, so a rank's payload meets only the same collective of the same unit on
#   the other ranks, whose sizes are the same; a payload of another collective or unit is never received
#   against it (it waits, unread, and the header names the fault). The tags take none of gloo's collective
#   slots, so they cannot meet a collective the script or the engine runs meanwhile on the same group.
# - The headers travel in issue order on :data:`HEADER_TAG` (first-in first-out between two ranks) and are
#   compared in that order: when a collective's work is waited for, every header issued before it over the group
#   is compared first (:func:`_compare_through`), so a fault is named at its first collective, on every rank
#   that waits.
# - The collectives with a result needed at once (:func:`collective`: HSDP's all-reduce across replicas,
#   world-size-invariant mode's reductions and gradient norm, a user's communication hook or custom collective)
#   compare their header before they are posted, as before; they use gloo's collectives. Their headers say so:
#   one meeting an asynchronous collective (whose payload waits on a tag) is named at once, not by the timeout.
# Invariant: the comparison's outcome is the same as comparing before posting; only its place moves: a
# mismatch raises where the first mismatched collective is waited for (or at the next blocking one).

_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# Point-to-point tags: below gloo's collective slots (those carry a prefix in the top byte), apart from p2p.py's
# own (REDUCE_SCATTER_TAG, ALL_GATHER_TAG) and from small tags a script may use.
HEADER_TAG = 0x5EA3
_PAYLOAD_TAG_BASE = 0x40000000
_label_of_crc: dict[int, str] = {}  # every unit name seen here: the other ranks' CRCs are named back with it


def payload_tag(kind: str, label: str) -> int:
    """The point-to-point tag of unit ``label``'s ``kind`` collectives under the check (see the note above)."""
    return _PAYLOAD_TAG_BASE | (zlib.crc32(f"{kind}:{label}".encode()) & 0x3FFFFFFF)


def _header(kind: str, label: str, pg: dist.ProcessGroup, blocking: bool) -> array.array:
    """Kind (offset by ``len(_KINDS)`` for a collective compared before it is posted: it must not meet an
    asynchronous one, whose payload travels on another channel), unit CRC, group count, forward count."""
    crc = zlib.crc32(label.encode())
    _label_of_crc.setdefault(crc, label)
    code = _KINDS.index(kind) + (len(_KINDS) if blocking else 0)
    return array.array("q", [code, crc, _issued.get(pg, 0), _forwards])


def _describe(header: list[int]) -> str:
    code, crc, count, forwards = header
    kind = _KINDS[code % len(_KINDS)] + (" (compared before it is posted)" if code >= len(_KINDS) else "")
    label = _label_of_crc.get(crc, f"<CRC-32 {crc:#010x}>")
    return f"{kind} of unit {label!r} (collective #{count} of its group) in its forward #{forwards}"


class _Exchange:
    """One header sent to and received from every other rank of a group (point-to-point, :data:`HEADER_TAG`).

    The header's buffers are Python arrays seen as tensors (``torch.frombuffer``, no copy): building and reading
    them dispatches no ATen op. They live here until :meth:`compare` has waited for every transfer."""

    def __init__(self, kind: str, label: str, pg: dist.ProcessGroup, blocking: bool) -> None:
        self.where = f"check before the {_where(kind, label, pg)}, in forward #{_forwards} of this process"
        self.ranks, self.me = dist.get_process_group_ranks(pg), dist.get_rank(pg)
        n = len(self.ranks)
        mine = _header(kind, label, pg, blocking)
        self.headers = [mine if r == self.me else array.array("q", bytes(32)) for r in range(n)]
        with _named(self.where):
            sends = [pg.send([_view(self.headers[self.me])], r, HEADER_TAG) for r in range(n) if r != self.me]
            self.works = sends + [pg.recv([_view(self.headers[r])], r, HEADER_TAG) for r in range(n) if r != self.me]

    def compare(self) -> None:
        with _named(self.where):
            for work in self.works:
                work.wait()
        _raise_if_out_of_step([h.tolist() for h in self.headers], self.ranks, self.me)


def _view(header: array.array) -> torch.Tensor:
    return torch.frombuffer(header, dtype=torch.int64)


# per group, the headers sent and not yet compared, in issue order; and the error that stopped a group
_uncompared: weakref.WeakKeyDictionary[dist.ProcessGroup, collections.deque[_Exchange]] = weakref.WeakKeyDictionary()
_failed: weakref.WeakKeyDictionary[dist.ProcessGroup, BaseException] = weakref.WeakKeyDictionary()
# What a failed check leaves posted (receives gloo may still write into): kept for the life of the process.
_kept_after_failure: list[object] = []


def _send_header(kind: str, label: str, pg: dist.ProcessGroup, blocking: bool) -> _Exchange:
    exchange = _Exchange(kind, label, pg, blocking)
    queue = _uncompared.get(pg)
    if queue is None:
        queue = _uncompared[pg] = collections.deque()
    queue.append(exchange)
    return exchange


def _compare_through(pg: dist.ProcessGroup, exchange: _Exchange) -> None:
    """Compare, in issue order, every header over ``pg`` up to ``exchange`` not compared yet; raise on the first
    that disagrees (and at every later call: the group's collectives are out of step for good)."""
    failed = _failed.get(pg)
    if failed is not None:
        raise failed
    queue = _uncompared.get(pg)
    while queue and exchange in queue:
        first = queue.popleft()
        try:
            first.compare()
        except (DesyncError, PeerLostError) as exc:
            _failed[pg] = exc
            _kept_after_failure.append(first)
            raise


class _CheckedWork:
    """A ``dist.Work``-like handle: ``wait()`` compares the headers through this collective's, then waits for it."""

    def __init__(self, pg: dist.ProcessGroup, exchange: _Exchange, works: list[Any]) -> None:
        self._pg, self._exchange, self._works = pg, exchange, works

    def wait(self, timeout: Any = None) -> bool:
        if self._exchange is not None:
            try:
                _compare_through(self._pg, self._exchange)
            except BaseException:
                _kept_after_failure.append(self._works)  # posted receives into the caller's buffers
                raise
            self._exchange = None
        for work in self._works:
            work.wait()
        self._works = []
        return True


def issue(kind: str, label: str, pg: dist.ProcessGroup | None, post: Callable[[int | None], list[Any]]) -> list[Any]:
    """Count, check and post the asynchronous collectives of ``kind`` for unit ``label`` over ``pg``; their works.

    ``post(tag)`` posts them and returns their works: point-to-point on ``tag`` when it is not ``None``. With the
    header check on (gloo), the header is sent, ``post(payload_tag(kind, label))`` runs at once, and the one work
    returned compares the headers before it waits (see [Note: the check off the critical path]). Otherwise as
    :func:`collective` around ``post(None)``."""
    if _size(pg) == 1 or pg is None or debug_enabled() or not check_enabled(pg):
        with collective(kind, label, pg):
            return [w for w in post(None) if w is not None]
    _issued[pg] = _issued.get(pg, 0) + 1
    exchange = _send_header(kind, label, pg, blocking=False)
    with _named(f"{_where(kind, label, pg)}, in forward #{_forwards} of this process"):
        works = [w for w in post(payload_tag(kind, label)) if w is not None]
    return [_CheckedWork(pg, exchange, works)]


def _compare_headers(kind: str, label: str, pg: dist.ProcessGroup | None) -> None:
    """Exchange this rank's header over ``pg`` and compare it, with every one sent before it; raise on every rank
    if any rank is about to run another kind of collective or another unit's. The counts are only reported: a
    forward without collectives (NO_SHARD) is no desync, and a process that caught an earlier error on one rank
    would never run in step again."""
    if pg is None:
        return
    _compare_through(pg, _send_header(kind, label, pg, blocking=True))


def _raise_if_out_of_step(headers: list[list[int]], ranks: list[int], me: int) -> None:
    """Raise :class:`DesyncError` naming each rank's collective if any rank's kind or unit differs from this one's."""
    n = len(headers)
    if all(h[:2] == headers[0][:2] for h in headers):
        return
    others = [(r, h) for r, h in zip(ranks, headers) if h[:2] != headers[me][:2]]
    rank, other = others[0]
    listing = "; ".join(f"rank {r}: {_describe(h)}" for r, h in zip(ranks, headers))
    raise DesyncError(
        f"[rank {global_rank()}] ranks are out of step: this rank is about to run {_describe(headers[me])}, "
        f"rank {rank} {_describe(other)}." + (f" All: {listing}." if n > 2 else "") + " Every rank must run "
        f"the same forwards and backwards, with units in one order (caught before the collective ran; {CHECK_VAR}=0 "
        "turns this check off)."
    )

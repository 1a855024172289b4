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
- By default on gloo groups: the engine's collectives are checked in step. Its asynchronous gathers and
  reductions travel point-to-point on a tag of their own kind, unit and place in the group's sequence, so a rank
  out of step waits (never a payload of another size: no abort); once a wait lasts, ``check_watch.py`` compares
  the ranks' records of their recent collectives (the kind, a CRC-32 of the unit's name, how many collectives
  the group ran, how many forwards this process ran) and every rank raises :class:`DesyncError` naming each
  rank's collective, unit and counts. Collectives whose result is needed at once exchange a 32-byte header of
  the same fields first (:data:`HEADER_TAG`). See [Note: the check off the critical path].
  ``FULLSHARD_CHECK_COLLECTIVES=0`` turns it off. Not on NCCL and other device backends: their payloads do not
  go point-to-point here.
- With ``FULLSHARD_DEBUG=1`` (or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``), on every backend: the same comparison
  with the full descriptions (``all_gather_object``, a pickle and two collectives each time).

Invariants: under the check the engine's gathers and reductions take the point-to-point path of ``p2p.py``: the
same gathers on any number of ranks and the same sums on 2; on 3 or more its sums add in rank order, which may
differ from gloo's own collective in the last bit (``FULLSHARD_CHECK_COLLECTIVES=0`` below the crossover sizes
of ``p2p.py``). What a mismatch cannot be caught against is a collective outside the engine (the script's own
``all_reduce``, a barrier): the payloads travel point-to-point and never meet it, and a rank waiting there
never answers the watch, so both wait for the group's timeout, which names where. After a :class:`DesyncError`
the mismatched collectives stay posted: the job is over.
"""

from __future__ import annotations

import array
import contextlib
import os
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from fullshard.engine import check_watch, p2p
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
    """Whether the engine's collectives over ``pg`` are checked in step (the module note): gloo, unless
    ``FULLSHARD_CHECK_COLLECTIVES=0``."""
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


def _where(kind: str, label: str, pg: dist.ProcessGroup | None, count: int | None = None) -> str:
    """The collective numbered ``count`` (by default the last one counted over ``pg``) in words."""
    if count is None:
        count = _issued.get(pg, 0) if pg is not None else 0
    return f"{kind} of unit {label!r} (collective #{count} of its group)"


def _check_where(kind: str, label: str, count: int, forwards: int) -> str:
    """Where a rank waits under the check, as its errors name it (the launch summary quotes the words)."""
    return f"check before the {_where(kind, label, None, count)}, in forward #{forwards} of this process"


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
        _raise_named(exc, where)


def _raise_named(exc: RuntimeError, where: str) -> NoReturn:
    """Raise ``exc`` (from issuing or waiting for the ``where`` collective) as what it means: a lost peer or a
    desync (a timeout: the other ranks did not come)."""
    if isinstance(exc, (DesyncError, PeerLostError)):
        raise exc
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


# --- the check (see the module note) ----------------------------------------------------------------------
#
# [Note: the check off the critical path]
# A header exchanged and compared before its collective is posted makes the ranks meet at every collective: each
# waits for the slowest at every gather and reduction it issues, where without the check it would post the
# collective and go on computing (measured: 10-16% of a small model's step). Sending the header beside the
# payload and comparing at the wait (the fourteenth session's design) still cost two small messages per
# collective and rank pair (2-7% of the small model's CPU). So the asynchronous collectives carry no header:
# - They (a unit's gather, its tensor-subclass parameters' gather, its gradients' reduction: :func:`issue`) go
#   point-to-point (``p2p.py``) on a tag drawn from their kind, unit and count in the group
#   (``check_watch.payload_tag``). A payload meets only the same collective at the same place on the other ranks
#   (the same size, so never gloo's abort), and a rank out of step waits for a payload that does not come. The
#   tags take none of gloo's collective slots, so they cannot meet a collective the script or the engine runs
#   meanwhile on the same group.
# - Which collectives disagree is found by ``check_watch.py`` only once a wait lasts ([Note: the check without
#   headers]): the ranks compare their records of recent collectives, note the first that differs, and the
#   waiting rank is woken to raise the same :class:`DesyncError` the header gave.
# - The collectives with a result needed at once (:func:`collective`: HSDP's all-reduce across replicas,
#   world-size-invariant mode's reductions and gradient norm, a user's communication hook or custom collective)
#   exchange and compare a header (:data:`HEADER_TAG`) before they are posted, as before; they use gloo's
#   collectives. Their headers and records say so: one meeting an asynchronous collective is named by the
#   watch, not by the timeout.
# Invariant: the comparison's outcome is that of comparing every collective's kind and unit in issue order; only
# its place moves: a mismatch raises where the first mismatched collective is waited for (or at the next issue).

_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# Point-to-point tags: below gloo's collective slots (those carry a prefix in the top byte), apart from p2p.py's
# own (REDUCE_SCATTER_TAG, ALL_GATHER_TAG), the watch's (check_watch.DIAG_TAG) and from small tags a script uses.
HEADER_TAG = 0x5EA3
_label_of_crc: dict[int, str] = {}  # every unit name seen here: the other ranks' CRCs are named back with it
_crcs: dict[tuple[str, str], tuple[int, int]] = {}  # (kind, unit) -> (the unit's CRC, the kind and unit's CRC)


def _crcs_of(kind: str, label: str) -> tuple[int, int]:
    """The CRC-32 of unit ``label`` (records, headers) and of ``kind`` with it (payload tags): computed once."""
    crcs = _crcs.get((kind, label))
    if crcs is None:
        crc = zlib.crc32(label.encode())
        _label_of_crc.setdefault(crc, label)
        crcs = _crcs[(kind, label)] = (crc, zlib.crc32(f"{kind}:{label}".encode()))
    return crcs


def _record(kind: str, label: str, pg: dist.ProcessGroup, blocking: bool) -> check_watch.Record:
    """This rank's record of the collective just counted over ``pg``, kept for the watch: kind (offset by
    ``len(_KINDS)`` for a collective compared before it is posted), unit CRC, group count, forward count."""
    record = (_KINDS.index(kind) + (len(_KINDS) if blocking else 0), _crcs_of(kind, label)[0], _issued[pg], _forwards)
    check_watch.note(pg, record)
    return record


def payload_tag(kind: str, label: str, count: int) -> int:
    """The point-to-point tag of unit ``label``'s ``kind`` collective numbered ``count`` in its group."""
    return check_watch.payload_tag(_crcs_of(kind, label)[1], count)


def _describe(header: list[int] | tuple[int, ...] | None) -> str:
    if header is None:
        return "not known here (it agrees with this rank, or has not answered)"
    code, crc, count, forwards = header
    kind = _KINDS[code % len(_KINDS)] + (" (compared before it is posted)" if code >= len(_KINDS) else "")
    label = _label_of_crc.get(crc, f"<CRC-32 {crc:#010x}>")
    return f"{kind} of unit {label!r} (collective #{count} of its group) in its forward #{forwards}"


# per group, the error that stopped it; what a failed check leaves posted is kept for the life of the process
_failed: weakref.WeakKeyDictionary[dist.ProcessGroup, BaseException] = weakref.WeakKeyDictionary()
_kept_after_failure: list[object] = []


def _stopped(pg: dist.ProcessGroup) -> BaseException | None:
    """The error that stopped ``pg``: a header that disagreed, or a mismatch the watch noted (made an error once)."""
    failed = _failed.get(pg)
    if failed is None:
        found = check_watch.mismatch(pg)
        if found is not None:
            own, others = found
            headers = {pg.rank(): own, **others}
            failed = _failed[pg] = _out_of_step(headers, dist.get_process_group_ranks(pg), pg.rank())
    return failed


def _wait_watched(wait: check_watch.Wait, works: list[Any], where: Callable[[], str]) -> None:
    """Wait for ``works`` (the messages of ``wait``) as the watch expects: announced, and the mismatch it may have
    noted raised before anything received is used (a released wait received nothing real)."""
    pg = wait.pg
    check_watch.begin_wait(wait)
    try:
        failed = _stopped(pg)
        if failed is None:
            try:
                for work in works:
                    work.wait()
            except RuntimeError as exc:
                failed = _stopped(pg)
                if failed is None:
                    _raise_named(exc, where())
                raise failed from exc
            failed = _stopped(pg)
    finally:
        check_watch.end_wait()
    if failed is not None:
        _kept_after_failure.append(works)  # posted receives into the caller's buffers
        raise failed


class _Exchange:
    """One header sent to and received from every other rank of a group (point-to-point, :data:`HEADER_TAG`),
    before a blocking collective.

    The header's buffers are Python arrays seen as tensors (``torch.frombuffer``, no copy): building and reading
    them dispatches no ATen op. They live here until :meth:`compare` has waited for every transfer."""

    def __init__(self, kind: str, label: str, pg: dist.ProcessGroup) -> None:
        self.where = _check_where(kind, label, _issued[pg], _forwards)
        self.ranks, self.me, self.pg = dist.get_process_group_ranks(pg), dist.get_rank(pg), pg
        n = len(self.ranks)
        mine = array.array("q", _record(kind, label, pg, blocking=True))
        self.headers = [mine if r == self.me else array.array("q", bytes(32)) for r in range(n)]
        with _named(self.where):
            sends = [pg.send([_view(self.headers[self.me])], r, HEADER_TAG) for r in range(n) if r != self.me]
            self.works = sends + [pg.recv([_view(self.headers[r])], r, HEADER_TAG) for r in range(n) if r != self.me]
        self.wait = check_watch.Wait(pg, _issued[pg], HEADER_TAG, [32])

    def compare(self) -> None:
        try:
            _wait_watched(self.wait, self.works, lambda: self.where)
            _raise_if_out_of_step([h.tolist() for h in self.headers], self.ranks, self.me)
        except (DesyncError, PeerLostError) as exc:
            _failed.setdefault(self.pg, exc)
            _kept_after_failure.append(self)
            raise


def _view(header: array.array) -> torch.Tensor:
    return torch.frombuffer(header, dtype=torch.int64)


class _CheckedWork:
    """A ``dist.Work``-like handle for an asynchronous collective under the check: ``wait()`` waits as the watch
    expects and raises the mismatch it found, if any (see [Note: the check off the critical path])."""

    def __init__(self, wait: check_watch.Wait, works: list[Any], kind: str, label: str, forwards: int) -> None:
        self._wait, self._works, self._what = wait, works, (kind, label, forwards)

    def _where(self) -> str:
        kind, label, forwards = self._what
        return _check_where(kind, label, self._wait.count, forwards)

    def wait(self, timeout: Any = None) -> bool:
        if self._works is not None:
            works, self._works = self._works, None
            _wait_watched(self._wait, works, self._where)
        return True


def issue(kind: str, label: str, pg: dist.ProcessGroup | None, post: Callable[[int | None], list[Any]]) -> list[Any]:
    """Count, check and post the asynchronous collectives of ``kind`` for unit ``label`` over ``pg``; their works.

    ``post(tag)`` posts them and returns their works: point-to-point on ``tag`` when it is not ``None``. With the
    check on (gloo), ``post`` runs at once on the collective's own tag, and the one work returned waits as the
    watch expects (see [Note: the check off the critical path]). Otherwise as :func:`collective` around
    ``post(None)``."""
    if _size(pg) == 1 or pg is None or debug_enabled() or not check_enabled(pg):
        with collective(kind, label, pg):
            return [w for w in post(None) if w is not None]
    failed = _stopped(pg)
    if failed is not None:
        raise failed
    count = _issued[pg] = _issued.get(pg, 0) + 1
    _record(kind, label, pg, blocking=False)
    tag = payload_tag(kind, label, count)
    sizes: list[int] = []
    p2p.recorded_sizes = sizes
    try:
        works = [w for w in post(tag) if w is not None]
    except RuntimeError as exc:
        _raise_named(exc, f"{_where(kind, label, pg)}, in forward #{_forwards} of this process")
    finally:
        p2p.recorded_sizes = None
    return [_CheckedWork(check_watch.Wait(pg, count, tag, sizes), works, kind, label, _forwards)]


def _compare_headers(kind: str, label: str, pg: dist.ProcessGroup | None) -> None:
    """Exchange this rank's header over ``pg`` and compare it; raise on every rank if any rank is about to run
    another kind of collective or another unit's, or at another count in the group. The forward counts are only
    reported: a forward without collectives (NO_SHARD) is no desync."""
    if pg is None:
        return
    failed = _stopped(pg)
    if failed is not None:
        raise failed
    _Exchange(kind, label, pg).compare()


def _raise_if_out_of_step(headers: list[list[int]], ranks: list[int], me: int) -> None:
    """Raise :class:`DesyncError` naming each rank's collective if any rank's kind, unit or count in the group
    differs from this one's (headers pair first-in first-out on one tag, so they could pair across counts; the
    counts must agree anyway: the payloads' tags carry them)."""
    if any(h[:3] != headers[me][:3] for h in headers):
        raise _out_of_step(dict(enumerate(headers)), ranks, me)


def _out_of_step(headers: dict[int, Any], ranks: list[int], me: int) -> DesyncError:
    """The error naming this rank's collective and the others' (``headers``: by group rank, the known ones)."""
    n = len(ranks)
    mine = headers[me]
    others = [(r, h) for i, (r, h) in enumerate(zip(ranks, [headers.get(i) for i in range(n)]))
              if h is not None and i != me and tuple(h[:3]) != tuple(mine[:3])]  # fmt: skip
    rank, other = others[0]
    listing = "; ".join(f"rank {r}: {_describe(headers.get(i))}" for i, r in enumerate(ranks))
    return DesyncError(
        f"[rank {global_rank()}] ranks are out of step: this rank is about to run {_describe(mine)}, "
        f"rank {rank} {_describe(other)}." + (f" All: {listing}." if n > 2 else "") + " Every rank must run "
        f"the same forwards and backwards, with units in one order (caught before the collective ran; {CHECK_VAR}=0 "
        "turns this check off)."
    )

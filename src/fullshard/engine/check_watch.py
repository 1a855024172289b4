"""The watch: finds which collective ranks disagree on, without a message per collective.

[Note: the check without headers]
Under the check (``collective_check.py``), each asynchronous gather and reduction goes point-to-point
(``p2p.py``) on a tag drawn from its kind, its unit **and its count** in the group (:func:`payload_tag`). Messages
match only on the same tag, so a payload only ever meets the same collective, at the same place in the group's
sequence, on the other ranks: equal sizes, never gloo's size-mismatch abort, and a rank out of step never
receives a payload meant for another collective. Out of step, a rank's wait for its payload simply does not end.
Nothing else travels with the payloads; finding *which* collectives disagree is left to this module, and costs
nothing until a wait lasts:

- Every rank keeps a short record of the collectives it issued over each group (:func:`note`: count, kind, CRC-32
  of the unit, forward count), the last :data:`RECORDS_KEPT` of them.
- A waiting main thread says so (:func:`begin_wait` / :func:`end_wait`: two assignments). A watchdog thread (one
  per process) looks every :data:`POLL_S`; once a wait has lasted :data:`FIRST_QUERY_S`, and then at doubling
  intervals, it sends every other rank of the group a query: this rank's recent records, and the tag and sizes of
  the messages its wait is for.
- Each rank answers on a listener thread of its own for the group (started with its first query: a rank that has
  never waited that long is either fine or waiting too, and then starts its own). The listener compares the
  asker's records with its own at the same counts; the first count where both ranks have a record and the kinds
  or units differ is the mismatch. It notes it for its own rank and replies with its record at that count, so the
  asker notes it too.
- A rank that has noted a mismatch while its main thread waits cannot wake that wait itself (gloo's waits cannot
  be interrupted, and a timed wait closes the pair for good), so it asks the other ranks to: each mirrors the
  waited messages, a send of the same size for every receive, a receive for every send, on the same tag. The main
  thread, woken, finds the mismatch noted (:func:`mismatch`) before it uses anything it received, and raises.
  The mismatch is noted before the release is asked for, on the asker's side, so it cannot be missed.

What it cannot name: a rank that never waits in the engine (it waits in the script's own collective, or it
stopped) never starts its listener; the asker's query waits unread and the group's timeout ends the wait, as it
would have without the check. A rank merely slower than the others answers nothing (its records, at the counts it
has reached, agree) and the asker goes on waiting. A wait for more than :data:`_MAX_SIZES` messages per rank (a
unit with that many directly gathered parameters) is released only in part: it raises the noted mismatch when
the group's timeout ends it.

Invariants: only the diagnostic tag (:data:`DIAG_TAG`) carries the watch's messages, so they never meet a
payload or a collective. What the watch leaves posted is bounded: a group's questions go out from one thread at a
time, which waits until every rank has read them (no new question over the group before); everything else it
sends (an answer naming a mismatch, a release request, the mirrored messages) follows a mismatch, after which
the group is over, and is kept posted, never waited for (a listener waiting on another rank's listener could wait
on one that waits on it).
"""

from __future__ import annotations

import array
import contextlib
import os
import threading
import time
import weakref
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DIAG_TAG",
    "FIRST_QUERY_S",
    "RECORDS_KEPT",
    "Record",
    "Wait",
    "begin_wait",
    "end_wait",
    "mismatch",
    "note",
    "payload_tag",
    "stats",
]

Record = tuple[int, int, int, int]
"""(kind code, CRC-32 of the unit's name, count in the group, forwards of the process) of one collective."""

RECORDS_KEPT = 64  # per group: far more than the collectives a rank can have posted and not waited for
POLL_S = 0.1  # how often the watchdog looks at the main thread's wait
FIRST_QUERY_S = 0.5  # a wait this long asks the other ranks where they are; then after 1, 2, 4, ... s more
DIAG_TAG = 0x5EA4  # the watch's own messages (below gloo's collective slots, apart from p2p.py's and the header's)
_PAYLOAD_TAG_BASE = 0x40000000
_QUERY, _DIFFERS, _RELEASE = 1, 2, 3
# The watch's own waits may last the life of the job. A gloo wait with no timeout of its own takes the group's,
# and one that expires closes the group's connections for good: a listener idle for that long would break a
# healthy group. So they name a timeout of their own.
_FOREVER = timedelta(days=3650)
_MESSAGE_LEN = 1024  # int64 slots of one diagnostic message (a fixed size: gloo's receive needs one)
_SHOWN_RECORDS = 16  # records a query carries: the waited one's neighbours, up to the newest
_MAX_SIZES = _MESSAGE_LEN - 4 * _SHOWN_RECORDS - 8

_records: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, Record]] = weakref.WeakKeyDictionary()
_mismatches: weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[Record, dict[int, Record]]] = (
    weakref.WeakKeyDictionary()
)
_listeners: dict[dist.ProcessGroup, threading.Thread] = {}  # a group once listened to is kept: its thread waits on it
_asking: weakref.WeakKeyDictionary[dist.ProcessGroup, threading.Thread] = weakref.WeakKeyDictionary()
_kept: list[Any] = []  # what a mismatch leaves posted (release requests, mirrored messages): never waited for
_lock = threading.Lock()
_watchdog: threading.Thread | None = None
_waiting: Wait | None = None  # the main thread's wait in progress, if any
_counts = {"queries": 0, "mismatches": 0, "releases": 0}


def stats() -> dict[str, int]:
    """How many queries this process sent, mismatches it noted and releases it mirrored (for tests)."""
    return dict(_counts)


def payload_tag(kind_crc: int, count: int) -> int:
    """The point-to-point tag of the collective numbered ``count`` in its group, whose kind and unit hash to
    ``kind_crc``: equal on two ranks only for the same collective at the same place (see the note)."""
    return _PAYLOAD_TAG_BASE | (zlib.crc32(count.to_bytes(8, "little"), kind_crc) & 0x3FFFFFFF)


def note(pg: dist.ProcessGroup, record: Record) -> None:
    """Keep ``record`` (the collective just issued over ``pg``) for the other ranks' queries."""
    records = _records.get(pg)
    if records is None:
        records = _records[pg] = {}
    records[record[2]] = record
    records.pop(record[2] - RECORDS_KEPT, None)


def mismatch(pg: dist.ProcessGroup) -> tuple[Record, dict[int, Record]] | None:
    """The first collective over ``pg`` on which this rank and others disagree, once noted: (this rank's record,
    {group rank: its record}); ``None`` while none is known."""
    return _mismatches.get(pg)


class Wait:
    """The main thread's wait for the messages of one collective: ``sizes`` bytes each way with every other rank,
    in order, on ``tag`` (what a release mirrors)."""

    __slots__ = ("count", "next_query", "pg", "since", "sizes", "tag")

    def __init__(self, pg: dist.ProcessGroup, count: int, tag: int, sizes: list[int]) -> None:
        self.pg, self.count, self.tag, self.sizes = pg, count, tag, sizes
        self.since, self.next_query = 0.0, FIRST_QUERY_S


def begin_wait(wait: Wait) -> None:
    """The main thread is about to block on ``wait``'s messages. The caller checks :func:`mismatch` after this
    (a mismatch noted before it would otherwise ask for no release)."""
    global _waiting
    wait.since = time.monotonic()
    _waiting = wait
    if _watchdog is None or not _watchdog.is_alive():
        _start_watchdog()


def end_wait() -> None:
    global _waiting
    _waiting = None


def _start_watchdog() -> None:
    global _watchdog
    with _lock:
        if _watchdog is None or not _watchdog.is_alive():
            _watchdog = threading.Thread(target=_watch, name="fullshard-check-watchdog", daemon=True)
            _watchdog.start()


def _watch() -> None:
    while True:
        time.sleep(POLL_S)
        wait = _waiting
        if wait is None:
            continue
        waited = time.monotonic() - wait.since
        if waited < wait.next_query:
            continue
        wait.next_query = 2 * waited
        with contextlib.suppress(RuntimeError):  # the group broke: the main thread's wait raises what broke it
            _query(wait)


def _post_send(pg: dist.ProcessGroup, message: array.array | torch.Tensor, peer: int, tag: int) -> Any:
    tensor = torch.frombuffer(message, dtype=torch.int64) if isinstance(message, array.array) else message
    work = pg.send([tensor], peer, tag)
    return (message, tensor, work)  # the buffers live as long as the send


def _peers(pg: dist.ProcessGroup) -> list[int]:
    me = pg.rank()
    return [r for r in range(pg.size()) if r != me]


def _message(kind: int, records: list[Record], tail: list[int]) -> array.array:
    body = [kind, len(records)] + [v for r in records for v in r] + tail
    return array.array("q", body + [0] * (_MESSAGE_LEN - len(body)))


def _query(wait: Wait) -> None:
    """Ask every other rank of ``wait``'s group where it is, from a thread of the group's own that waits until
    every rank has read the question: while one has not (it never waited this long, so never listens), no new
    question goes out over the group, and a question is never left unread behind another."""
    pg = wait.pg
    asking = _asking.get(pg)
    if asking is not None and asking.is_alive():
        return
    _listen(pg)
    records = _records.get(pg, {})
    # The waited collective, the two before it and those issued after it (prefetched ones). Looked up one by one:
    # the main thread may add a record meanwhile (a dict's single lookups are safe from another thread).
    around = (records.get(c) for c in range(wait.count - 2, wait.count + _SHOWN_RECORDS - 2))
    shown = [record for record in around if record is not None]
    sizes = wait.sizes[:_MAX_SIZES]
    message = _message(_QUERY, shown, [pg.rank(), wait.tag, len(sizes), *sizes])
    sends = [_post_send(pg, message, peer, DIAG_TAG) for peer in _peers(pg)]
    _counts["queries"] += 1
    _asking[pg] = thread = threading.Thread(target=_wait_sends, args=(sends,), name="fullshard-check-ask", daemon=True)
    thread.start()


def _wait_sends(sends: list[Any]) -> None:
    with contextlib.suppress(RuntimeError):  # the group broke: nobody is left to ask
        for _, _, work in sends:
            work.wait(_FOREVER)


def _listen(pg: dist.ProcessGroup) -> None:
    with _lock:
        if pg in _listeners:
            return
        thread = threading.Thread(target=_serve, args=(pg,), name="fullshard-check-listener", daemon=True)
        _listeners[pg] = thread
        thread.start()


def _serve(pg: dist.ProcessGroup) -> None:
    """Answer the other ranks' queries over ``pg`` until the group breaks (its peers ended)."""
    with contextlib.suppress(RuntimeError):
        while True:
            buffer = torch.zeros(_MESSAGE_LEN, dtype=torch.int64)
            pg.recv_anysource([buffer], DIAG_TAG).wait(_FOREVER)
            _handle(pg, buffer.tolist())


def _parse(message: list[int]) -> tuple[int, list[Record], list[int]]:
    n = message[1]
    flat = message[2 : 2 + 4 * n]
    records = [(flat[i], flat[i + 1], flat[i + 2], flat[i + 3]) for i in range(0, 4 * n, 4)]
    return message[0], records, message[2 + 4 * n :]


def _handle(pg: dist.ProcessGroup, message: list[int]) -> None:
    """Act on one message. Its answer (only to a query that shows a mismatch: a group over) is kept, not waited
    for: a listener waiting on another rank's listener could wait on one that waits on it."""
    kind, theirs, tail = _parse(message)
    sender = tail[0]
    mine = _records.get(pg, {})
    if kind == _QUERY:
        for record in sorted(theirs, key=lambda r: r[2]):
            own = mine.get(record[2])
            if own is not None and own[:2] != record[:2]:
                _kept.append(_post_send(pg, _message(_DIFFERS, [own], [pg.rank()]), sender, DIAG_TAG))
                _noted(pg, own, {sender: record})
                return
    elif kind == _DIFFERS and theirs:
        own = mine.get(theirs[0][2])
        if own is not None:
            _noted(pg, own, {sender: theirs[0]})
    elif kind == _RELEASE:
        tag, n = tail[1], tail[2]
        _counts["releases"] += 1
        for size in tail[3 : 3 + n]:  # in the waiter's order: messages on one tag match first-in first-out
            inbound = torch.empty(size, dtype=torch.uint8)
            _kept.append((inbound, pg.recv([inbound], sender, tag)))
            _kept.append(_post_send(pg, torch.zeros(size, dtype=torch.uint8), sender, tag))


def _noted(pg: dist.ProcessGroup, own: Record, others: dict[int, Record]) -> None:
    """Note the first mismatch over ``pg`` (later ones add nothing); if the main thread waits on ``pg``, ask the
    other ranks to release its wait. The order matters: noted first, then released (see the note). The release
    requests are kept, not waited for: a rank that never listens must not hold this thread."""
    with _lock:
        if pg in _mismatches:
            return
        _mismatches[pg] = (own, others)
    _counts["mismatches"] += 1
    wait = _waiting
    if wait is not None and wait.pg is pg:
        sizes = wait.sizes[:_MAX_SIZES]
        release = _message(_RELEASE, [], [pg.rank(), wait.tag, len(sizes), *sizes])
        _kept.extend(_post_send(pg, release, peer, DIAG_TAG) for peer in _peers(pg))


def _after_fork() -> None:
    global _watchdog, _waiting
    _watchdog, _waiting = None, None
    _listeners.clear()
    _asking.clear()
    _kept.clear()


os.register_at_fork(after_in_child=_after_fork)

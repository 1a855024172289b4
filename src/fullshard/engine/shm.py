"""Gathers and reductions between ranks of one host through shared memory, instead of gloo's loopback sockets.

[Note: the same-host transport]
``p2p.py``'s pairwise all-gather and reduce-scatter move every payload through a TCP socket when the ranks share a
host: the sender's bytes are copied into the kernel and out again on the receiving side, with the protocol's work
around them. On the medium GPT of ``benchmarks/train.py steps`` that kernel time, 0.56-0.68 ms per MB (DDP's
bucketed all-reduce: 0.32-0.47), was most of what a FULL_SHARD step spent beyond DDP's (notes 17 and 18). Here
the payload goes through memory both processes map instead, and only a 64-byte header goes through gloo:

- A sender copies its payload (a gather's shard, or the chunks a reduction sends to each peer) into a *region*: a
  ``memfd`` of its own, mapped shared, taken from its pool for that size. It posts one header to each peer on the
  collective's tag: which region (its fd, a serial number), where in it, how many bytes, and its sequence number.
- A receiver posts the header receives at once, as it posted the payload receives before, and in ``wait()`` reads
  the peer's region where the header says (mapped once through ``/proc/<pid>/fd/<fd>``, then kept): a gather
  copies it into place, a reduction adds it straight from there, in the order ``p2p.py`` documents. It then
  acknowledges the message in the region's own acknowledgement word for its rank, and the sender reuses the
  region once every reader has (a message never read keeps only its own region busy). Per rank and 12 MiB
  collective on 2 ranks, that is one copy on each side instead of two through TCP.

Nothing here waits on another rank beyond the headers' gloo messages: a region still being read is never reused
(a new one is made), so a peer that dies or falls out of step leaves gloo's receive waiting as before, and the
group's timeout, ``PeerLostError`` and the collective check (``collective_check.py``: the headers travel on the
collective's tag and are the sizes its watch mirrors) behave as on the socket path. A header that is not one (the
watch's mirrored message after a mismatch) reads nothing.

When it runs: on Linux x86-64 (the acknowledgement relies on its ordering of a receiver's reads before its later
write) for a gloo group whose ranks all share this host, this user and this PID namespace and may open each
other's descriptors, as found once per process by :func:`connect` (collectives at the first root unit's lazy
init), unless ``FULLSHARD_CPU_SHM=0`` (on by default; ``0`` sends every payload through the sockets, as
before). The setting is read at each collective (a benchmark row can run with it while another runs without);
like ``FULLSHARD_GLOO_P2P``, it must be the same on every rank.

Numerics: bitwise the socket path's: the same bytes arrive, and sums add in the same order.

Memory: a sender's pool holds its messages in flight (not yet read by every peer), a few unit shards at most; a
reader maps its peers' regions and drops the pages it read once it acknowledged them, so a page is resident in
its owner only. Regions stay mapped for the process's life, for the next step's messages of a similar size (a
model's collectives repeat a few sizes); where the process returns freed memory to the kernel, their pages are
freed between messages too (``connect``'s ``keep_idle_regions``). Payloads above
:data:`LARGEST_MESSAGE_BYTES` per peer (4 MiB: units of a large model, where compute dominates) keep the sockets.

Descriptors: a region's memfd stays open only until every peer has read a message there (and so mapped it);
mappings keep none, and a group that never sends makes none. A process that creates thousands of groups (a
test suite's workers) holds a handful. Channels are found by the group's name, not its Python object: torch may
hand out a new object for the same group.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import itertools
import mmap
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ENV_VAR",
    "HEADER_BYTES",
    "LARGEST_MESSAGE_BYTES",
    "TRAFFIC",
    "Channel",
    "Traffic",
    "channel",
    "connect",
]

ENV_VAR = "FULLSHARD_CPU_SHM"

LARGEST_MESSAGE_BYTES = 4 * 2**20
"""A payload per peer above this goes through the sockets. A staged copy costs its size in memory from the send
until the peer has read it, and its region stays for the next message of its size, where the sockets send from
the caller's buffer and hold nothing; above this, the copies saved are a small part of a step. Measured
(docs/benchmarks.md, twenty-first session): at 32 MiB, the 840M GPT's units (8-32 MiB per parameter and peer)
went through regions and its peak RSS per rank rose by 33 MiB (a message's staged copy beside the output its
reader fills); at 4 MiB the 840M peak is the sockets' to 1 MiB, and the medium GPT's step is the same within
noise (only its 8 MiB root messages move back to the sockets)."""

HEADER_BYTES = 64
# The first word of a header: anything else (a released wait's filler) reads nothing. _MAGIC: no other reader reads
# these bytes (a reduction's chunk, or a gather between 2 ranks); _MAGIC_SHARED: other readers read them too.
_MAGIC = 0x46534853484D0001
_MAGIC_SHARED = 0x46534853484D0002
_PAGE = mmap.PAGESIZE


@dataclass
class Traffic:
    """Payload bytes this process has put in its regions for peers to read, counted once per reading peer (what
    the socket path would have sent; benchmarks count that path's bytes in c10d's send ops)."""

    sent: int = 0


TRAFFIC = Traffic()

# By global rank, once connect() ran: (host key, or None where this transport cannot run there; pid). None before.
_endpoints: list[tuple[object, int]] | None = None
# By the group's name: torch may hand out a new Python object for the same group (the channel must not change).
_channels: dict[str, Channel | None] = {}
# Whether idle regions keep their pages (connect's keep_idle_regions).
_keep_idle = True
# Regions are numbered across the process, and peers' regions mapped here are found by (their pid, that number),
# not per channel: group names are not an identity a rank can rely on (torch names a subgroup by a hash of its
# ranks and of how many groups are alive, so two groups may share a name on one rank and not on another, and one
# rank's channel then serves two groups whose messages another rank reads through two channels).
_region_serials = itertools.count(1)
_mapped: dict[tuple[int, int], _PeerRegion] = {}
# Channels with a descriptor open that a peer may still need (swept whenever any channel sends): a process that
# creates many groups (a test suite) must not run out of descriptors.
_holding_descriptors: list[Channel] = []


def _wanted() -> bool:
    value = os.environ.get(ENV_VAR, "1").strip().lower()
    if value not in ("0", "1", ""):
        raise ValueError(f"{ENV_VAR}={value!r}: expected 1 (shared memory between ranks of one host, the default) "
                         "or 0 (gloo's sockets, for every payload)")  # fmt: skip
    return value != "0"


def _host_key() -> object | None:
    """What two processes must share to map each other's memfds: the boot, the PID namespace and the user."""
    if not (sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") and hasattr(os, "memfd_create")):
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return (boot, os.stat("/proc/self/ns/pid").st_ino, os.getuid())
    except OSError:
        return None


def connect(*, keep_idle_regions: bool = True) -> None:
    """Find which ranks share this host and can map each other's memory (two gathers over the default group,
    once per process; every rank calls it at the same point: the first root unit's lazy init). Raises on a bad
    ``FULLSHARD_CPU_SHM``.

    Sharing the boot, the PID namespace and the user is not always enough: a security policy (a hardened
    container, ``hidepid``, an LSM) may refuse to open another process's descriptors. So each rank offers a
    one-page probe and tries its host's peers' probes; where any rank of a host could not, that host's ranks
    keep the sockets (decided alike on every rank, from the second gather).

    ``keep_idle_regions``: whether a region no message is using keeps its pages for the next (the default, as
    the engine asks glibc to keep freed memory: ``cpu_memory.py``), or returns them to the kernel until then
    (where the process returns its freed memory too: the next message there faults its pages in again)."""
    global _endpoints, _keep_idle
    _keep_idle = keep_idle_regions
    if not _wanted() or _endpoints is not None or not dist.is_initialized() or dist.get_world_size() == 1:
        return  # turned off: no gather (a later root's lazy init with it on still connects)
    from fullshard.ranks import gather_from_ranks  # ranks imports the engine's modules

    key, probe = _host_key(), -1
    if key is not None:
        with contextlib.suppress(OSError):  # none to offer (a sandbox): this host keeps the sockets, below
            probe = os.memfd_create("fullshard-shm-probe", os.MFD_CLOEXEC)
    try:
        offered = gather_from_ranks((key, os.getpid(), probe))
        failed = key is not None and not all(fd >= 0 and _can_open(pid, fd) for k, pid, fd in offered if k == key)
        refused = gather_from_ranks(failed)  # every rank's probe stays open until every rank has tried
    finally:
        if probe >= 0:
            os.close(probe)
    unusable = {k for (k, _, _), bad in zip(offered, refused, strict=True) if bad}
    _endpoints = [(None if k in unusable else k, pid) for k, pid, _ in offered]


def _can_open(pid: int, fd: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.close(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR))
    except OSError:
        return False
    return True


def channel(pg: dist.ProcessGroup, payload_bytes: int, device: torch.device) -> Channel | None:
    """This rank's channel over ``pg`` for a payload of ``payload_bytes`` per peer on ``device``, or ``None`` where
    ``pg``'s ranks do not all share this host (or before :func:`connect`), for a payload not on CPU or above
    :data:`LARGEST_MESSAGE_BYTES`, or with ``FULLSHARD_CPU_SHM=0``. The same answer on every rank of ``pg``
    (given the same setting on each, as for ``FULLSHARD_GLOO_P2P``)."""
    if device.type != "cpu" or payload_bytes > LARGEST_MESSAGE_BYTES:
        return None
    if not _wanted():
        return None
    try:
        return _channels[pg.group_name]
    except KeyError:
        pass
    if _endpoints is None:
        return None  # not decided (and not kept): connect() has not run in this process yet
    found = None
    ranks = dist.get_process_group_ranks(pg)
    keys = {_endpoints[r][0] for r in ranks}
    if len(keys) == 1 and None not in keys and len(ranks) > 1:
        found = Channel(pg.rank(), [_endpoints[r][1] for r in ranks])
    _channels[pg.group_name] = found
    return found


def _map(path: str, nbytes: int = _PAGE) -> ctypes.Array:
    """``nbytes`` of the file at ``path``, mapped shared for the process's life, as a ctypes byte array: no
    descriptor kept (Python's ``mmap`` keeps one per mapping), and tensors over it made by ``torch.frombuffer``,
    which dispatches no op (a view per call would be ops dispatched per collective)."""
    fd = os.open(path, os.O_RDWR)
    try:
        address = _libc_mmap()(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {nbytes} bytes of {path} failed")
    return (ctypes.c_char * nbytes).from_address(address)


@functools.cache
def _libc_mmap() -> Any:
    mmap_fn = ctypes.CDLL(None, use_errno=True).mmap
    mmap_fn.restype = ctypes.c_void_p
    mmap_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return mmap_fn


def _drop_pages(memory: ctypes.Array) -> None:
    """Unmap ``memory``'s pages from this process (``MADV_DONTNEED``: the shared pages themselves are untouched,
    and the next access maps them again, a minor fault per few pages with the kernel's fault-around)."""
    _madvise(ctypes.addressof(memory), ctypes.sizeof(memory), mmap.MADV_DONTNEED)


def _free_pages(memory: ctypes.Array, start: int, end: int) -> None:
    """Free the whole pages of ``memory`` between byte ``start`` and ``end`` (``MADV_REMOVE``: returned to the
    kernel in every process that maps them, not just unmapped here); the partial pages at either end stay."""
    first, last = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if last > first:
        _madvise(ctypes.addressof(memory) + first, last - first, mmap.MADV_REMOVE)


def _madvise(address: int, nbytes: int, advice: int) -> None:
    if _libc_madvise()(address, nbytes, advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice}) of {nbytes} bytes of shared memory failed")


@functools.cache
def _libc_madvise() -> Any:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.restype = ctypes.c_int
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _open_peer(what: Callable[[str], object], pid: int, fd: int) -> object:
    """``what`` of another process's memfd ``fd`` (:func:`_map`)."""
    try:
        return what(f"/proc/{pid}/fd/{fd}")
    except (OSError, RuntimeError) as exc:
        raise RuntimeError(
            f"fullshard's same-host transport could not map process {pid}'s shared memory ({exc}); a security "
            f"policy may forbid it: set {ENV_VAR}=0 on every rank to send through gloo's sockets"
        ) from exc


@dataclass
class _Region:
    """One memfd of a sender's pool: the readers' acknowledgement words (one int64 per rank of the group, written
    by each reader: the number of the last message of ours it read here), then the payload. ``readers``: for each
    peer reading it, the number of the message it reads there; the region is free again once each peer's word has
    reached it. ``fd`` is closed (``-1``) once every peer has read a message there, so has mapped it."""

    fd: int
    serial: int
    nbytes: int
    memory: ctypes.Array
    acks: memoryview
    readers: dict[int, int] = field(default_factory=dict)
    views: dict[tuple[torch.dtype, int, int], torch.Tensor] = field(default_factory=dict)
    resident: bool = True  # False once its payload pages were returned to the kernel (Channel._release_idle)

    def typed_view(self, dtype: torch.dtype, offset: int, numel: int) -> torch.Tensor:
        """``numel`` elements of ``dtype`` from byte ``offset``: made once, then kept (a step's collectives repeat,
        and a view made per call would be ops dispatched per call)."""
        return _typed(self.views, self.memory, dtype, offset, numel)

    def idle(self) -> bool:
        return all(self.acks[peer] >= seq for peer, seq in self.readers.items())


def _typed(
    views: dict[tuple[torch.dtype, int, int], torch.Tensor],
    memory: ctypes.Array,
    dtype: torch.dtype,
    offset: int,
    numel: int,
) -> torch.Tensor:
    key = (dtype, offset, numel)
    view = views.get(key)
    if view is None:  # frombuffer refuses a count of 0 (a rank's empty shard of a tiny parameter)
        if numel == 0:
            view = torch.empty(0, dtype=dtype)
        else:
            view = torch.frombuffer(memory, dtype=dtype, count=numel, offset=offset)
        views[key] = view
    return view


@dataclass
class _PeerRegion:
    """A peer's region as this rank maps it, with the typed views read from it and its acknowledgement words."""

    memory: ctypes.Array
    acks: memoryview
    views: dict[tuple[torch.dtype, int, int], torch.Tensor] = field(default_factory=dict)


def _size_class(nbytes: int) -> int:
    """The payload room of the regions that carry ``nbytes``: rounded up to a sixteenth to a thirty-second of
    its size (a page at least), so sizes within a few percent of each other share a pool, at most 1/16 unused."""
    step = max(_PAGE, 1 << max(nbytes.bit_length() - 5, 0))
    return max(step, -(-nbytes // step) * step)


def _ack_words(memory: ctypes.Array, size: int) -> memoryview:
    """A region's first ``size`` int64 words (its readers' acknowledgements), read and written without an op."""
    return memoryview(memory).cast("B")[: 8 * size].cast("q")


class Channel:
    """One rank's end of the same-host transport over a group of ``len(pids)`` ranks (``rank`` is this one).

    Invariants: messages to each peer are numbered 1, 2, ... in the order they are posted; a reader acknowledges a
    message by writing its number in the region it read, at its own rank's word, after its last read there; a
    region is reused only when every reader's word has reached the message it reads there. A message never read
    (its work dropped unwaited) keeps only its own region busy. Regions are kept for the channel's life (a model's
    collectives repeat a few sizes) and known to readers by their process's serial number, never by descriptor
    (nor by channel: a reader may read one channel's messages through two, see ``_mapped``)."""

    def __init__(self, rank: int, pids: list[int]) -> None:
        self.rank, self.pids, self.size = rank, pids, len(pids)
        self._payload_at = -(-8 * self.size // 64) * 64  # the acknowledgement words, a cache line apart from data
        self._sent = [0] * self.size
        self._pools: dict[int, list[_Region]] = {}
        self._open: list[_Region] = []  # regions whose descriptor some peer may still need to map them

    @property
    def payload_offset(self) -> int:
        """Where a region's payload starts (its acknowledgement words come first)."""
        return self._payload_at

    # --- sending -------------------------------------------------------------------------------------

    def take_region(self, nbytes: int, readers: list[int]) -> tuple[_Region, dict[int, int]]:
        """A region with room for ``nbytes`` of payload that no peer still reads, numbered for ``readers``:
        ``(region, seq by reader)``. Pools are per size class (:func:`_size_class`), so that messages of nearly
        the same size (a model's units differ by a norm or a bias) share their regions."""
        self._close_mapped()
        _holding_descriptors[:] = [ch for ch in _holding_descriptors if ch is not self and ch._close_mapped()]
        capacity = _size_class(nbytes)
        pool = self._pools.setdefault(capacity, [])
        region = next((r for r in pool if r.idle()), None)
        if region is None:
            region = self._new_region(self._payload_at + capacity)
            pool.append(region)
            self._open.append(region)
        if not _keep_idle:
            self._release_idle(region)
        seqs = {}
        for peer in readers:
            self._sent[peer] += 1
            seqs[peer] = self._sent[peer]
        region.readers = dict(seqs)
        if self._close_mapped():  # kept in the sweep until its peers have mapped what it holds open
            _holding_descriptors.append(self)
        return region, seqs

    def _release_idle(self, taken: _Region) -> None:
        """Return the payload pages of every idle region but ``taken`` to the kernel (the page that holds the
        acknowledgement words stays)."""
        taken.resident = True
        for pool in self._pools.values():
            for region in pool:
                if region.resident and region is not taken and region.idle():
                    _free_pages(region.memory, self._payload_at, region.nbytes)
                    region.resident = False

    def header_for(self, region: _Region, seq: int, offset: int, nbytes: int, shared: bool = False) -> array.array:
        """``offset``: from the payload's start; ``shared``: other readers read the same bytes (a gather over
        more than 2 ranks), so no reader may free them."""
        magic = _MAGIC_SHARED if shared else _MAGIC
        return array.array("q", [magic, seq, region.fd, region.serial, self._payload_at + offset, nbytes, self.size,
                                 region.nbytes])  # fmt: skip

    def _close_mapped(self) -> bool:
        """Close the descriptors of the regions every peer has mapped by now (it read a message there, and
        acknowledged it). Whether any is left open."""
        if self._open:
            still_open = []
            for region in self._open:
                if region.idle():
                    os.close(region.fd)
                    region.fd = -1
                else:
                    still_open.append(region)
            self._open = still_open
        return bool(self._open)

    def _new_region(self, nbytes: int) -> _Region:
        size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        fd = os.memfd_create("fullshard-shm", os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)  # out of memory is an error here, not a SIGBUS at the first write
            memory = _map(f"/proc/self/fd/{fd}", size)
        except OSError as exc:
            os.close(fd)
            raise RuntimeError(
                f"fullshard's same-host transport could not allocate {size} bytes of shared memory ({exc}); "
                f"free memory, or set {ENV_VAR}=0 on every rank to send through gloo's sockets"
            ) from exc
        return _Region(fd, next(_region_serials), size, memory, _ack_words(memory, self.size))

    # --- receiving -----------------------------------------------------------------------------------

    def message_view(self, peer: int, header: array.array, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        """The ``numel`` elements of ``dtype`` that ``peer``'s ``header`` points at (a view of its region), or
        ``None`` where the header is not one of this transport's for that many bytes (nothing is read then)."""
        magic, _, fd, serial, offset, size, group_size, region_bytes = header
        nbytes = numel * dtype.itemsize
        if (
            magic not in (_MAGIC, _MAGIC_SHARED)
            or size != nbytes
            or group_size != self.size
            or offset < self._payload_at
            or offset + nbytes > region_bytes
        ):
            return None
        key = (self.pids[peer], serial)
        region = _mapped.get(key)
        if region is None:  # its first message: the peer keeps the descriptor open until this rank acknowledges
            memory = _open_peer(functools.partial(_map, nbytes=region_bytes), self.pids[peer], fd)
            region = _mapped[key] = _PeerRegion(memory, _ack_words(memory, self.size))
        return _typed(region.views, region.memory, dtype, offset, numel)

    def acknowledge(self, peer: int, header: array.array) -> None:
        """Acknowledge ``peer``'s message (after the last read of it, which :meth:`message_view` mapped): its
        region may be reused. The pages read are then dropped from this process's mapping (they stay in the
        peer's region, which its own resident size counts): a page is counted once, in its owner, and mapped
        again here at the next read. Where idle regions return their pages (``connect``), the message's own
        whole pages are freed here (unless its header says other readers read them too), before the
        acknowledgement lets the sender write there again: a staged payload lives from the copy to this read."""
        region = _mapped[(self.pids[peer], header[3])]
        if not _keep_idle and header[0] == _MAGIC:
            _free_pages(region.memory, header[4], header[4] + header[5])
        # x86-64: the reads before are ordered before this write (see the module's note)
        region.acks[self.rank] = header[1]
        _drop_pages(region.memory)


# --- the collectives ---------------------------------------------------------------------------------------


def all_gather(
    ch: Channel, output: torch.Tensor, shard: torch.Tensor, pg: dist.ProcessGroup, tag: int
) -> tuple[list[dist.Work], Callable[[], None]]:
    """Post ``p2p.pairwise_all_gather`` through ``ch``: the works and what ``wait()`` runs after them."""
    n, rank = ch.size, ch.rank
    chunks = output.view(n, shard.numel())
    nbytes = shard.numel() * shard.element_size()
    peers = [p for p in range(n) if p != rank]
    region, seqs = ch.take_region(nbytes, peers)
    region.typed_view(shard.dtype, ch.payload_offset, shard.numel()).copy_(shard)
    TRAFFIC.sent += nbytes * len(peers)
    sent = {p: ch.header_for(region, seqs[p], 0, nbytes, shared=len(peers) > 1) for p in peers}
    received = {p: array.array("q", bytes(HEADER_BYTES)) for p in peers}
    works = [pg.send([_view(sent[p])], p, tag) for p in peers]
    works += [pg.recv([_view(received[p])], p, tag) for p in peers]
    chunks[rank].copy_(shard)

    def finish() -> None:
        # As a receive into ``output`` would: no autograd, no version bump (it may be a view of a gathered buffer
        # that autograd saved, see collectives.copy_out).
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(output):
            for p in peers:
                theirs = ch.message_view(p, received[p], shard.dtype, shard.numel())
                if theirs is None:
                    return  # not a real message (the check released this wait): nothing read
                chunks[p].copy_(theirs)
                ch.acknowledge(p, received[p])
        sent.clear()

    return works, finish


def reduce_scatter(
    ch: Channel, output: torch.Tensor, full: torch.Tensor, pg: dist.ProcessGroup, tag: int
) -> tuple[list[dist.Work], Callable[[], None]]:
    """Post ``p2p.pairwise_reduce_scatter`` through ``ch``: the works and what ``wait()`` runs after them (the sum
    in ``p2p.py``'s order)."""
    n, rank = ch.size, ch.rank
    numel = output.numel()
    chunks = full.view(n, numel)
    nbytes = numel * full.element_size()
    peers = [p for p in range(n) if p != rank]
    region, seqs = ch.take_region(nbytes * (n - 1), peers)
    TRAFFIC.sent += nbytes * len(peers)
    for i, p in enumerate(peers):  # each peer's chunk, in peer order
        region.typed_view(full.dtype, ch.payload_offset + i * nbytes, numel).copy_(chunks[p])
    sent = {p: ch.header_for(region, seqs[p], i * nbytes, nbytes) for i, p in enumerate(peers)}
    received = {p: array.array("q", bytes(HEADER_BYTES)) for p in peers}
    works = [pg.send([_view(sent[p])], p, tag) for p in peers]
    works += [pg.recv([_view(received[p])], p, tag) for p in peers]

    def finish() -> None:
        rows = []
        for p in range(n):
            theirs = chunks[rank] if p == rank else ch.message_view(p, received[p], full.dtype, numel)
            if theirs is None:
                return  # not a real message (the check released this wait): nothing read
            rows.append(theirs)
        with torch.no_grad():
            torch.add(rows[0], rows[1], out=output)
            for row in rows[2:]:
                output.add_(row)
        for p in peers:
            ch.acknowledge(p, received[p])
        sent.clear()

    return works, finish


def _view(header: array.array) -> torch.Tensor:
    return torch.frombuffer(header, dtype=torch.int64)

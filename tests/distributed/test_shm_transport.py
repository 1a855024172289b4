"""The same-host transport (engine/shm.py): p2p's gathers and reductions through shared memory.

Set up: 2 and 4 gloo ranks of one host, after ``shm.connect()`` (what the first root unit's lazy init runs).
Check: every collective is bitwise the socket path's (the gathers gloo's own, the sums in rank order), with
several in flight and waited in any order; regions are reused once read, so a long run keeps a fixed pool; a
header that is not one reads nothing; ranks not all on one host, a payload too large or not on CPU, or
``FULLSHARD_CPU_SHM=0``, keep the sockets;
a bad setting is refused by name; training FULL_SHARD through it is bitwise training through the sockets.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import os
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fullshard.engine import p2p, shm
from fullshard.testing import WorkerPool
from fullshard.testing.parity import RunResult
from tests.distributed.test_p2p_collectives import FULL_SHARD, SPEC, _check_collectives, _in_flight_together, _run_with

_ONE = (4, torch.device("cpu"))  # a payload that fits: 4 bytes on CPU


def _connected(rank: int, world: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` with the transport on (``FULLSHARD_CPU_SHM=1``, for this call only) and this worker's channel
    over the world group."""
    with mock.patch.dict(os.environ, {shm.ENV_VAR: "1"}):
        shm.connect()
        assert shm.channel(dist.group.WORLD, *_ONE) is not None, "ranks of one host found no channel"
        return fn(rank, world, *args)


@pytest.mark.parametrize("keep", [True, False], ids=["regions kept", "pages freed"])
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_bitwise_through_shared_memory(
    pool2: WorkerPool, pool4: WorkerPool, world: int, keep: bool
) -> None:
    pool = pool2 if world == 2 else pool4
    assert pool.run(_connected, _with_idle_policy, keep, _check_collectives) == [[]] * world
    for checks in pool.run(_connected, _with_idle_policy, keep, _in_flight_together):
        assert all(checks), checks


def _with_idle_policy(rank: int, world: int, keep: bool, fn: Callable[..., Any]) -> Any:
    """``fn`` with idle regions kept, or returned (and read messages freed by their reader)."""
    with mock.patch.object(shm, "_keep_idle", keep):
        return fn(rank, world)


def _pool_after_many(rank: int, world: int) -> dict[str, object]:
    """200 rounds of a gather and a reduction posted together (waited in reverse every other round): the pools
    stay at a few regions per size, a descriptor is opened only for a new region, and every result is right."""
    shm.connect()
    pg = dist.new_group(list(range(world)))  # a channel of its own: the pools hold this test's regions only
    ch = shm.channel(pg, *_ONE)
    assert ch is not None
    wrong, warm = 0, (0, 0)
    for i in range(200):
        if i == 20:
            warm = (len(os.listdir("/proc/self/fd")), sum(len(pool) for pool in ch._pools.values()))
        full = torch.full((world * 1000,), float(rank + i))
        out = torch.empty(1000)
        gathered = torch.empty(world * 300)
        works = [p2p.pairwise_reduce_scatter(out, full, pg), p2p.pairwise_all_gather(gathered, full[:300], pg)]
        for work in works if i % 2 else reversed(works):
            work.wait()
        want = sum(float(r + i) for r in range(world))
        wrong += int(not torch.equal(out, torch.full((1000,), want)))
        wrong += int(not torch.equal(gathered.view(world, 300)[:, 0], torch.arange(world).float() + i))
    dist.barrier()  # every rank's last reads (and acknowledgements) are done
    return {
        "descriptors held": ch._close_mapped(),
        "group that sent nothing holds one": bool(shm.channel(dist.new_group(list(range(world))), *_ONE)._open),
        "wrong": wrong,
        "regions": max(len(pool) for pool in ch._pools.values()),
        "new fds": len(os.listdir("/proc/self/fd")) - warm[0],
        "new regions": sum(len(pool) for pool in ch._pools.values()) - warm[1],
    }


def test_regions_reused_once_read(pool2: WorkerPool) -> None:
    for seen in pool2.run(_connected, _pool_after_many):
        # descriptors close once the peers have mapped what they point at (the full suite's workers held 10,657
        # when they did not): none left for this group once every rank has read, and none made for a group that
        # sends nothing
        assert seen["descriptors held"] is False and seen["group that sent nothing holds one"] is False, seen
        assert seen["wrong"] == 0
        # messages in flight, plus a peer slow to read: a few regions for 200 rounds (a region per message
        # would be 200, and as many descriptors)
        assert seen["regions"] <= 4, seen
        assert seen["new regions"] <= 2 and seen["new fds"] <= 10, seen


def _not_one_host(rank: int, world: int) -> list[object]:
    """Channels are decided from the ranks' host keys: any differing key (or none) keeps the sockets; so do a
    payload above the largest message, one not on CPU, and ``FULLSHARD_CPU_SHM=0``."""
    shm.connect()
    saved = shm._endpoints
    assert saved is not None
    seen: list[object] = []
    try:
        shm._endpoints = [(("another host", r) if r == world - 1 else key, pid) for r, (key, pid) in enumerate(saved)]
        seen.append(shm.channel(dist.new_group(list(range(world))), *_ONE))
        rest = dist.new_group(list(range(world - 1)))  # every rank creates every group
        seen.append(shm.channel(rest, *_ONE) is not None if rank < world - 1 else True)  # the others share one host
        shm._endpoints = [(None, pid) for _, pid in saved]
        seen.append(shm.channel(dist.new_group(list(range(world))), *_ONE))
    finally:
        shm._endpoints = saved
    seen.append(shm.channel(dist.group.WORLD, shm.LARGEST_MESSAGE_BYTES + 1, torch.device("cpu")))
    seen.append(shm.channel(dist.group.WORLD, 4, torch.device("meta")))
    with mock.patch.dict(os.environ, {shm.ENV_VAR: "0"}):
        seen.append(shm.channel(dist.group.WORLD, *_ONE))
    with mock.patch.dict(os.environ, {shm.ENV_VAR: "shared"}):
        try:
            shm.channel(dist.group.WORLD, *_ONE)
        except ValueError as err:
            seen.append(str(err))
    return seen


def test_sockets_where_not_one_host_or_turned_off(pool4: WorkerPool) -> None:
    for seen in pool4.run(_connected, _not_one_host):
        assert seen[:6] == [None, True, None, None, None, None], seen
        assert "FULLSHARD_CPU_SHM='shared'" in seen[6] and "expected 1" in seen[6], seen[6]


def test_a_header_that_is_not_one_reads_nothing() -> None:
    """What the collective check's watch mirrors to release a wait (zeros), or a header for another size, is not
    read: no mapping is opened, and the receiver's buffers stay as they were."""
    ch = shm.Channel(0, [os.getpid(), os.getpid()])
    region, seqs = ch.take_region(4096, [1])
    header = ch.header_for(region, seqs[1], 0, 4096)
    assert ch.message_view(1, array.array("q", bytes(shm.HEADER_BYTES)), torch.uint8, 4096) is None
    assert ch.message_view(1, header, torch.uint8, 2048) is None  # another size than the receiver expects
    beyond = array.array("q", header)
    beyond[4] = region.nbytes  # offset past the region
    assert ch.message_view(1, beyond, torch.uint8, 4096) is None
    assert (os.getpid(), region.serial) not in shm._mapped
    start = ch.payload_offset
    region.memory[start : start + 4] = bytes([1, 2, 3, 4])
    read = ch.message_view(1, header, torch.uint8, 4096)  # this process as its own peer: the region, through /proc
    assert read is not None and read[:4].tolist() == [1, 2, 3, 4]


def test_region_reused_only_after_every_reader_acknowledged() -> None:
    ch = shm.Channel(0, [os.getpid()] * 3)
    first, seqs = ch.take_region(8192, [1, 2])
    assert ch.take_region(8192, [1, 2])[0] is not first  # nobody read the first message yet
    first.acks[1] = seqs[1]
    assert ch.take_region(8192, [1, 2])[0] is not first  # rank 2 has not read it
    first.acks[2] = seqs[2]
    assert first.fd >= 0  # its readers have not all mapped it yet: its descriptor stays open
    assert ch.take_region(8192, [1, 2])[0] is first
    assert first.fd == -1  # both readers read a message there (so mapped it): the descriptor is closed


def test_a_message_never_read_keeps_only_its_own_region() -> None:
    """A receiver that drops a work unwaited never reads its message: that region stays busy, the next are
    reused (acknowledgements are per region, not a watermark that one gap would stop)."""
    sender, receiver = shm.Channel(0, [os.getpid()] * 2), shm.Channel(1, [os.getpid()] * 2)
    unread, seqs = sender.take_region(4096, [1])
    for _ in range(5):
        region, seqs = sender.take_region(4096, [1])
        header = sender.header_for(region, seqs[1], 0, 4096)
        assert receiver.message_view(0, header, torch.uint8, 4096) is not None
        receiver.acknowledge(0, header)
    assert sum(len(pool) for pool in sender._pools.values()) == 2  # the unread one and one reused four times
    assert not unread.idle()


def test_training_bitwise_the_sockets(pool2: WorkerPool) -> None:
    """FULL_SHARD through shared memory (``FULLSHARD_CPU_SHM=1``; regions kept between messages, and returned
    to the kernel between them) against the same run through the sockets."""
    sockets = pool2.run(_run_with_shm, "0")
    for keep in (True, False):
        shared = pool2.run(_run_with_shm, "1", keep)
        for got, want in zip(shared, sockets, strict=True):
            assert got.losses == want.losses
            for name, param in want.params.items():
                assert torch.equal(got.params[name], param), name


def _run_with_shm(rank: int, world: int, setting: str, keep: bool = True) -> RunResult:
    connect = shm.connect
    with (
        mock.patch.dict(os.environ, {shm.ENV_VAR: setting}),
        mock.patch.object(shm, "connect", lambda **_: connect(keep_idle_regions=keep)),  # the engine's call too
    ):
        try:
            shm.connect()
            assert (shm.channel(dist.group.WORLD, *_ONE) is not None) == (setting == "1")
            return _run_with(rank, world, "1", SPEC, FULL_SHARD)
        finally:
            connect()  # the default again: regions kept


def _empty_payloads(rank: int, world: int) -> list[bool]:
    """A rank's shard can be empty (a parameter smaller than the group): nothing to map, the same results."""
    shm.connect()
    pg = dist.new_group(list(range(world)))
    out, gathered = torch.full((0,), 1.0), torch.full((0,), 1.0)
    p2p.pairwise_reduce_scatter(out, torch.empty(0), pg).wait()
    p2p.pairwise_all_gather(gathered, torch.empty(0), pg).wait()
    return [shm.channel(pg, 0, out.device) is not None, out.numel() == 0, gathered.numel() == 0]


def test_empty_payloads(pool2: WorkerPool) -> None:
    for checks in pool2.run(_connected, _empty_payloads):
        assert all(checks), checks


def test_nearby_sizes_share_a_pool_and_waste_at_most_a_sixteenth() -> None:
    """A model's units differ by a norm or a bias: their messages share regions (one pool per size class)."""
    for nbytes in [0, 1, 4095, 4096, 4097, 65_537, 2_098_176, 2_107_396, 8 * 2**20, shm.LARGEST_MESSAGE_BYTES]:
        room = shm._size_class(nbytes)
        assert room >= nbytes and room % 4096 == 0, (nbytes, room)
        assert room - nbytes <= max(4096, nbytes // 16), (nbytes, room)
    ch = shm.Channel(0, [os.getpid()] * 2)
    regions = []
    for nbytes in (2_098_176, 2_099_200, 2_107_396):  # three block sizes of benchmarks/train.py's medium GPT
        region, seqs = ch.take_region(nbytes, [1])
        region.acks[1] = seqs[1]  # read
        regions.append(region)
    assert regions[0] is regions[1] is regions[2]
    assert ch.take_region(4 * 2**20, [1])[0] is not regions[0]  # another class


def _resident_kib(address: int) -> int:
    """The resident size of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.split(" ", 1)[0].split("-")[0] == f"{address:x}":
            return next(int(entry.split()[1]) for entry in lines[i + 1 :] if entry.startswith("Rss:"))
    raise AssertionError(f"no mapping at {address:x}")


@pytest.mark.parametrize("keep", [True, False])
def test_a_read_message_is_counted_once_in_its_senders_memory(monkeypatch: pytest.MonkeyPatch, keep: bool) -> None:
    """After acknowledging, a reader drops the pages it read from its own mapping (they stay in the sender's
    region): a rank's resident size counts its own regions, not its peers' as well; the next read maps them
    again and reads what the sender wrote since. Where idle regions return their pages, the reader frees the
    message's pages as it acknowledges: the sender holds none of them after the read."""
    monkeypatch.setattr(shm, "_keep_idle", keep)
    sender, receiver = shm.Channel(0, [os.getpid()] * 2), shm.Channel(1, [os.getpid()] * 2)
    nbytes = 64 * 4096
    for value in (3, 7):
        region, header = _post(sender, nbytes, value)
        read = receiver.message_view(0, header, torch.uint8, nbytes)
        assert read is not None and int(read.sum()) == value * nbytes
        mapping = shm._mapped[(os.getpid(), header[3])].memory
        assert _resident_kib(ctypes.addressof(mapping)) >= nbytes // 1024
        receiver.acknowledge(0, header)
        assert _resident_kib(ctypes.addressof(mapping)) == 0
        sender_kib = _resident_kib(ctypes.addressof(region.memory))
        assert sender_kib >= nbytes // 1024 if keep else sender_kib <= 8, sender_kib  # its partial first and last
    assert sum(len(pool) for pool in sender._pools.values()) == 1  # the region was reused for the second


def test_turned_off_the_start_exchanges_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``FULLSHARD_CPU_SHM=0``: the first root's lazy init makes no collective for the transport; turned on, one
    gather of every rank's host and pid."""
    gathered: list[object] = []
    monkeypatch.setattr(shm, "_endpoints", None)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr("fullshard.ranks.gather_from_ranks", lambda mine: gathered.append(mine) or [mine, mine])
    monkeypatch.setenv(shm.ENV_VAR, "0")
    shm.connect()
    assert gathered == [] and shm._endpoints is None
    monkeypatch.setenv(shm.ENV_VAR, "1")
    shm.connect()
    (key, pid, probe), refused = gathered  # the host and a probe to open, then whether this rank could
    assert (key, pid, refused) == (shm._host_key(), os.getpid(), False) and probe >= 0
    assert "/memfd:fullshard-shm-probe (deleted)" not in _open_files()  # closed once every rank tried


def _open_files() -> list[str]:
    files = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            files.append(os.readlink(f"/proc/self/fd/{fd}"))
    return files


def _one_rank_may_not_open(rank: int, world: int) -> list[bool]:
    """Rank 1 may not open its peers' descriptors (a security policy), or may not make one to offer (a
    sandbox): every rank of that host keeps the sockets, decided alike on each, and nobody waits on a rank that
    raised; without either the same ranks find a channel."""
    saved, memfd_create = shm._endpoints, os.memfd_create
    seen = []

    def no_memfd(*args: Any) -> int:
        if rank == 1:
            raise OSError(38, "memfd_create: function not implemented")
        return memfd_create(*args)

    try:
        for case in ("refused", "no probe", "fine"):
            shm._endpoints = None
            with (
                mock.patch.object(shm, "_can_open", lambda pid, fd, case=case: not (case == "refused" and rank == 1)),
                mock.patch.object(shm.os, "memfd_create", no_memfd if case == "no probe" else memfd_create),
            ):
                shm.connect()
            seen.append(shm.channel(dist.new_group(list(range(world))), *_ONE) is None)
    finally:
        shm._endpoints = saved
    return seen


def test_ranks_that_may_not_open_each_others_memory_keep_the_sockets(pool2: WorkerPool) -> None:
    assert pool2.run(_connected, _one_rank_may_not_open) == [[True, True, False]] * 2


@pytest.mark.parametrize("keep", [True, False])
def test_idle_regions_return_their_pages_where_freed_memory_is_returned(
    monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    """Where the process returns its freed memory to the kernel (the engine did not ask glibc to keep it: a
    user's own allocator settings), a region no message uses returns its payload pages too, and the next
    message there faults them in again; by default it keeps them."""
    monkeypatch.setattr(shm, "_keep_idle", keep)
    ch = shm.Channel(0, [os.getpid()] * 2)
    nbytes = 64 * 4096
    region, seqs = ch.take_region(nbytes, [1])
    region.typed_view(torch.uint8, ch.payload_offset, nbytes).fill_(5)
    region.acks[1] = seqs[1]  # read
    assert _resident_kib(ctypes.addressof(region.memory)) >= nbytes // 1024
    ch.take_region(4096, [1])  # another size class: the first region is idle meanwhile
    resident = _resident_kib(ctypes.addressof(region.memory))
    assert resident >= nbytes // 1024 if keep else resident <= 4, resident
    again, _ = ch.take_region(nbytes, [1])
    assert again is region
    payload = region.typed_view(torch.uint8, ch.payload_offset, nbytes)
    assert int(payload.sum()) == (5 * nbytes if keep else 5 * (4096 - ch.payload_offset))  # the first page stays


def test_bytes_that_other_readers_read_too_are_not_freed_by_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gather over more than 2 ranks sends every peer the same bytes: where read messages are freed, the
    first reader to acknowledge must not free what the others have yet to read."""
    monkeypatch.setattr(shm, "_keep_idle", False)
    pids = [os.getpid()] * 3
    sender, first, second = shm.Channel(0, pids), shm.Channel(1, pids), shm.Channel(2, pids)
    nbytes = 16 * 4096
    region, seqs = sender.take_region(nbytes, [1, 2])
    region.typed_view(torch.uint8, sender.payload_offset, nbytes).fill_(9)
    headers = {p: sender.header_for(region, seqs[p], 0, nbytes, shared=True) for p in (1, 2)}
    for reader, rank in ((first, 1), (second, 2)):
        read = reader.message_view(0, headers[rank], torch.uint8, nbytes)
        assert read is not None and int(read.sum()) == 9 * nbytes, rank
        reader.acknowledge(0, headers[rank])


def test_one_channel_read_through_two_and_two_read_through_one() -> None:
    """A rank may serve two groups with one channel while its peer reads them through two (torch may give two
    groups one name on one rank only: names hash the ranks and the number of live groups), and the other way
    round. The CI run that found it: a region's descriptor, closed once the peer had mapped it through its first
    channel, then opened again through its second (``/proc/<pid>/fd/9: No such file``). Regions are found by
    (process, serial) across channels: both read right."""
    pids = [os.getpid()] * 2
    sender, through_a, through_b = shm.Channel(0, pids), shm.Channel(1, pids), shm.Channel(1, pids)
    nbytes = 4096
    for value, reader in ((3, through_a), (4, through_b)):
        region, header = _post(sender, nbytes, value)
        assert _read_and_acknowledge(reader, header, nbytes) == value
        sender.take_region(2 * 2**20, [1])  # another class: the first region, idle now, has its descriptor closed
        assert region.fd == -1 or value == 4
    one, two, reader = shm.Channel(0, pids), shm.Channel(0, pids), shm.Channel(1, pids)
    for value, sender in ((5, one), (6, two)):  # each channel's first region: their serials must not collide
        _, header = _post(sender, nbytes, value)
        assert _read_and_acknowledge(reader, header, nbytes) == value


def _post(sender: shm.Channel, nbytes: int, value: int) -> tuple[Any, array.array]:
    """A message of ``nbytes`` bytes equal to ``value`` from ``sender`` to rank 1: its region and header."""
    region, seqs = sender.take_region(nbytes, [1])
    region.typed_view(torch.uint8, sender.payload_offset, nbytes).fill_(value)
    return region, sender.header_for(region, seqs[1], 0, nbytes)


def _read_and_acknowledge(reader: shm.Channel, header: array.array, nbytes: int) -> int:
    """Rank 0's message read by ``reader`` (its first byte), then acknowledged."""
    read = reader.message_view(0, header, torch.uint8, nbytes)
    assert read is not None
    first = int(read[0])
    reader.acknowledge(0, header)
    return first

"""``fullshard.testing.memory``: a spawned process's peak RSS is its own, not its parent's.

Every peak-memory figure in the benchmarks and tests comes from ranks or subprocesses started from a larger
driver (a pytest session, a benchmark holding a checkpoint). ``ru_maxrss`` reports at least the parent's
resident size there (the reason the helper exists, asserted below so that a kernel that stops doing it is
noticed); ``peak_rss_bytes`` must report only what the child itself touched.
"""

from __future__ import annotations

import multiprocessing as mp
import resource

from fullshard.testing.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

MIB = 2**20
BALLAST = 512 * MIB
CHILD_BLOCK = 96 * MIB


def _touched(nbytes: int) -> bytearray:
    block = bytearray(nbytes)
    for i in range(0, nbytes, 4096):
        block[i] = 1  # resident, not just reserved
    return block


def _child(queue: mp.SimpleQueue) -> None:
    start = peak_rss_bytes()
    block = _touched(CHILD_BLOCK)
    grown = peak_rss_bytes()
    del block
    reset_peak_rss()
    after_reset = peak_rss_bytes()
    queue.put((start, grown, after_reset, rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def test_a_spawned_childs_peak_rss_is_its_own_not_its_parents() -> None:
    ballast = _touched(BALLAST)
    parent_rss = rss_bytes()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    start, grown, after_reset, child_rss, child_maxrss = queue.get()
    child.join(timeout=120)
    del ballast
    assert child.exitcode == 0
    # Why the helper exists: the kernel's ru_maxrss carried this (parent) process's size into the child.
    assert child_maxrss >= 0.9 * parent_rss, (child_maxrss, parent_rss)
    # The helper: the child's own high-water mark, well under the parent's size, and it sees the child grow.
    assert start < parent_rss - BALLAST // 2, (start, parent_rss)
    assert grown - start >= CHILD_BLOCK - 8 * MIB, (start, grown)
    # reset_peak_rss starts again from the current size (the freed block no longer counts).
    assert after_reset <= child_rss + 8 * MIB and after_reset < grown - CHILD_BLOCK // 2, (after_reset, grown)

"""The check's watch (``engine/check_watch.py``): a slow rank is waited for, a desynchronised one is named, on 2
and 4 ranks, with no message per collective."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from fullshard import FullyShardedDataParallel
from fullshard.engine import check_watch
from fullshard.engine.collective_check import DesyncError
from fullshard.engine.wrap import ModuleWrapPolicy
from fullshard.testing import WorkerPool
from tests.distributed import test_desync

_slow: tuple[int, float] | None = None  # (rank, seconds): that rank's blocks sleep this long in their forward


class _SleepyBlock(test_desync._Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _slow is not None and dist.get_rank() == _slow[0]:
            time.sleep(_slow[1])
        return super().forward(x)


class _TwoBlocks(test_desync._TwoBlocks):
    """``test_desync``'s two blocks (their order per rank), each asleep on the rank ``_slow`` names."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _SleepyBlock(), _SleepyBlock()


def _model(pg: dist.ProcessGroup) -> FullyShardedDataParallel:
    torch.manual_seed(0)
    return FullyShardedDataParallel(_TwoBlocks(), process_group=pg, auto_wrap_policy=ModuleWrapPolicy({_SleepyBlock}))


def _train(model: nn.Module, rank: int, steps: int, slow: list[tuple[int, float] | None], idle_s: float = 0.0) -> None:
    global _slow
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(steps):
            time.sleep(idle_s if step else 0.0)
            _slow = slow[step]
            model(torch.full((2, 4), float(rank + step))).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        _slow = None


def _slow_ranks(
    rank: int, world_size: int, slow: list[tuple[int, float] | None], timeout_s: float = 60, idle_s: float = 0.0
) -> tuple[list, dict, dict]:
    """Train a step per item of ``slow`` (which rank's blocks sleep in their forward, and how long), every rank
    idle ``idle_s`` between steps; the parameters and the watch's counts before and after."""
    pg = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=timeout_s))
    model = _model(pg)
    before = check_watch.stats()
    _train(model, rank, len(slow), slow, idle_s)
    after = check_watch.stats()
    with FullyShardedDataParallel.summon_full_params(model):
        params = [p.detach().clone() for p in model.parameters()]
    dist.barrier()
    dist.destroy_process_group(pg)
    return params, before, after


def test_a_slow_rank_is_waited_for_and_the_training_is_unchanged(pool2: WorkerPool) -> None:
    # Rank 1 sleeps 1 s in each block in step 1, rank 0 in step 2: the other waits past the watch's first query
    # both times, so each asks where the other is (rank 1's query about step 1 is read by rank 0's listener only
    # once rank 0 waits in step 2, stale by then). Records agree: nothing is named, and training is bitwise the
    # prompt one's.
    slow = pool2.run(_slow_ranks, [None, (1, 1.0), (0, 1.0)])
    prompt = pool2.run(_slow_ranks, [None, None, None])
    for rank, ((params, before, after), (want, _, _)) in enumerate(zip(slow, prompt)):
        assert after["queries"] > before["queries"], (rank, before, after)  # the wait did last: it asked
        assert after["mismatches"] == before["mismatches"] and after["releases"] == before["releases"]
        assert len(params) == len(want) == 4
        for got, expected in zip(params, want):
            assert torch.equal(got, expected)


def test_the_watch_outlives_the_groups_timeout(pool2: WorkerPool) -> None:
    # A gloo wait with no timeout of its own expires at the group's and then closes the group's connections: the
    # watch's listener and its unread question, idle for longer than that (4.5 s against a 3 s group timeout,
    # twice), must leave the group working.
    slow = [None, (1, 1.0), None, (0, 1.0), None]
    idle = pool2.run(_slow_ranks, slow, 3.0, 4.5)
    prompt = pool2.run(_slow_ranks, [None] * 5)
    for (params, before, after), (want, _, _) in zip(idle, prompt):
        assert after["queries"] > before["queries"] and after["mismatches"] == before["mismatches"]
        for got, expected in zip(params, want):
            assert torch.equal(got, expected)


def _another_order_on_the_last_rank(rank: int, world_size: int) -> tuple[str, float, dict, dict]:
    """Every rank trains a step; then the last rank runs the blocks in the other order. Every rank must name it."""
    pg = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=30))
    model = _model(pg)
    _train(model, rank, 1, [None])
    model.module.order = "ba" if rank == world_size - 1 else "ab"
    before, start, message = check_watch.stats(), time.monotonic(), ""
    try:
        model(torch.ones(2, 4)).sum().backward()
    except DesyncError as exc:
        message = str(exc)
    elapsed = time.monotonic() - start
    after = check_watch.stats()
    dist.barrier()
    dist.destroy_process_group(pg)
    return message, elapsed, before, after


def test_a_rank_out_of_step_among_four_is_named_by_every_rank(pool4: WorkerPool) -> None:
    results = pool4.run(_another_order_on_the_last_rank)
    for rank, (message, elapsed, before, after) in enumerate(results):
        assert message.startswith(f"[rank {rank}] ranks are out of step: this rank is about to run"), message
        mine, theirs = ("unit 'b'", "unit 'a'") if rank == 3 else ("unit 'a'", "unit 'b'")
        # Another rank whose collective differs: rank 3 for the others; for rank 3, whichever it heard from first.
        other = re.search(r", rank (\d) ", message)
        assert other and (other.group(1) != "3" if rank == 3 else other.group(1) == "3"), message
        assert message.index(mine) < other.start() < message.index(theirs), message
        assert " All: rank 0: " in message and "rank 3: all_gather of unit " in message, message
        assert after["mismatches"] == before["mismatches"] + 1, (before, after)
        # Named by the watch, not by the group's 30 s timeout (whose message is another); the bound only
        # catches a hang.
        assert elapsed < 25, f"rank {rank} took {elapsed:.1f}s"

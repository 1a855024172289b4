"""The worker pool runs functions on every rank, reports a failing rank, and recovers afterwards."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fullshard.testing import RankFailure, WorkerPool


def _all_reduce_rank(rank: int, world: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on one rank")
    dist.barrier()  # rank 0 hangs here until the process-group timeout
    return rank


def test_pool_runs_collectives(pool2: WorkerPool) -> None:
    assert pool2.run(_all_reduce_rank) == [1.0, 1.0]


def test_pool_reports_failure_and_recovers() -> None:
    pool = WorkerPool(2, grace_s=5)
    try:
        with pytest.raises(RankFailure, match="boom on one rank") as info:
            pool.run(_fail_on_rank1)
        assert 1 in info.value.failures
        assert pool.run(_all_reduce_rank) == [1.0, 1.0]
    finally:
        pool.close()

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


def _start_state(rank: int, world: int) -> tuple[bool, str | None, int]:
    import os
    import sys

    return (
        "fullshard.frontend.accelerator" in sys.modules,
        os.environ.get("FULLSHARD_POOL_PROBE"),
        torch.get_num_threads(),
    )


def test_a_gloo_pool_forks_preloaded_ranks_with_the_current_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # [Note: forked from a server] in fullshard/testing/pool.py: the ranks start with the Accelerator imported (no
    # 2.5 s of imports each), and with this process's environment as it is when the pool starts, as spawned ones
    monkeypatch.setenv("FULLSHARD_POOL_PROBE", "set after the server started")
    pool = WorkerPool(2)
    try:
        assert pool.run(_start_state) == [(True, "set after the server started", 1)] * 2
    finally:
        pool.close()
    fresh = WorkerPool(1, start_method="spawn")  # what on_fresh_ranks and a pool with its own env get
    try:
        assert fresh.run(_start_state) == [(False, "set after the server started", 1)]
    finally:
        fresh.close()

"""The point-to-point reduce-scatter and all-gather (engine/p2p.py) against gloo's own, and training through them.

Set up: random fp32 and bf16 buffers of uneven chunk sizes on 2 and 4 gloo ranks, one-rank groups.
Check: the all-gather is bitwise gloo's. The reduce-scatter is bitwise gloo's on 2 ranks (one addition,
which commutes); on 4 it is bitwise the rank-order sum of the gathered inputs (its documented order) and within
rounding of gloo's (gloo adds in another order: floating-point addition does not associate). Training FSDP
FULL_SHARD with the point-to-point collectives gives bitwise the losses and parameters of gloo's collectives
on 2 ranks, and matches single-process training on 4.
"""

from __future__ import annotations

import functools
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fullshard.engine import p2p, shm
from fullshard.engine.collectives import COMM_STATS, all_gather_flat, reduce_scatter_flat
from fullshard.testing import WorkerPool
from fullshard.testing.bench import ring_reduce_scatter
from fullshard.testing.parity import RunResult, TrainSpec, reference_run
from tests.distributed.test_parity import assert_parity, run, wrap_fsdp

CHUNKS = (1, 7, 1001)
DTYPES = (torch.float32, torch.bfloat16)


def _native_reduce_scatter(out: torch.Tensor, full: torch.Tensor, pg: dist.ProcessGroup) -> None:
    dist.reduce_scatter_tensor(out, full, group=pg)


def _check_collectives(rank: int, world: int) -> list[str]:
    """Compare every algorithm with gloo's on this rank; return what differs (empty: all as expected)."""
    pg, problems = dist.group.WORLD, []
    gen = torch.Generator().manual_seed(100 + rank)
    for dtype in DTYPES:
        for chunk in CHUNKS:
            full = (torch.randn(world * chunk, generator=gen) * 3).to(dtype)
            native = torch.empty(chunk, dtype=dtype)
            _native_reduce_scatter(native, full, pg)
            everyone = [torch.empty_like(full) for _ in range(world)]
            dist.all_gather(everyone, full)
            rank_order = everyone[0].view(world, chunk)[rank].clone()
            for other in everyone[1:]:
                rank_order += other.view(world, chunk)[rank]
            for name, fn in (("pairwise", p2p.pairwise_reduce_scatter), ("ring", ring_reduce_scatter)):
                got = torch.full((chunk,), float("nan"), dtype=dtype)
                fn(got, full, pg).wait()
                where = f"{name} reduce-scatter {dtype} chunk {chunk}"
                if world == 2 and not torch.equal(got, native):
                    problems.append(f"{where}: not bitwise gloo's")
                if name == "pairwise" and not torch.equal(got, rank_order):
                    problems.append(f"{where}: not bitwise the rank-order sum")
                # 4 ranks: 3 roundings each way; bf16 has 8 bits of mantissa, fp32 24.
                tol = 3 * 2**-8 if dtype == torch.bfloat16 else 3 * 2**-23
                if not torch.allclose(got.float(), native.float(), rtol=tol, atol=tol * 10):
                    problems.append(f"{where}: off gloo's by {(got.float() - native.float()).abs().max()}")
            shard = native
            want = torch.empty(world * chunk, dtype=dtype)
            dist.all_gather_into_tensor(want, shard, group=pg)
            got = torch.full_like(want, float("nan"))
            p2p.pairwise_all_gather(got, shard, pg).wait()
            if not torch.equal(got, want):
                problems.append(f"pairwise all-gather {dtype} chunk {chunk}: not bitwise gloo's")
    return problems


@pytest.mark.parametrize("world", [2, 4])
def test_p2p_collectives_match_gloo(pool2: WorkerPool, pool4: WorkerPool, world: int) -> None:
    pool = pool2 if world == 2 else pool4
    assert pool.run(_check_collectives) == [[]] * world


def _in_flight_together(rank: int, world: int) -> list[bool]:
    """Several calls posted before any wait, waited in reverse order, each lands its own result."""
    pg = dist.group.WORLD
    fulls = [torch.arange(world * n, dtype=torch.float32) * (rank + 1) for n in (5, 3, 8)]
    outs = [torch.empty(f.numel() // world) for f in fulls]
    gathered = torch.empty(world * 4)
    shard = torch.full((4,), float(rank))
    works = [p2p.pairwise_reduce_scatter(outs[0], fulls[0], pg), p2p.pairwise_all_gather(gathered, shard, pg)]
    works += [p2p.pairwise_reduce_scatter(o, f, pg) for o, f in zip(outs[1:], fulls[1:], strict=True)]
    for work in reversed(works):
        assert work.wait() and work.is_completed()
    works[0].wait()  # idempotent
    total = sum(range(1, world + 1))
    checks = [torch.equal(gathered, torch.arange(world).repeat_interleave(4).float())]
    for full, out in zip(fulls, outs, strict=True):
        base = torch.arange(full.numel(), dtype=torch.float32).view(world, -1)[rank]
        checks.append(torch.equal(out, base * total))
    return checks


def test_calls_in_flight_together(pool4: WorkerPool) -> None:
    for checks in pool4.run(_in_flight_together):
        assert all(checks), checks


def _one_rank_groups(rank: int, world: int) -> list[bool]:
    """Single-rank groups: the p2p functions and the engine's entry points both return the input."""
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    mine = groups[rank]
    full = torch.randn(6)
    out = torch.empty(6)
    p2p.pairwise_reduce_scatter(out, full, mine).wait()
    ring_out = torch.empty(6)
    ring_reduce_scatter(ring_out, full, mine).wait()
    gathered = torch.empty(6)
    p2p.pairwise_all_gather(gathered, full, mine).wait()
    flat_out = torch.empty(6)
    reduce_scatter_flat(flat_out, full, mine, async_op=False)
    flat_gathered = torch.empty(6)
    all_gather_flat(flat_gathered, full, mine, async_op=False)
    return [torch.equal(t, full) for t in (out, ring_out, gathered, flat_out, flat_gathered)]


def test_one_rank_group(pool2: WorkerPool) -> None:
    for checks in pool2.run(_one_rank_groups):
        assert all(checks), checks


def _policy(rank: int, world: int) -> dict[str, object]:
    pg, full = dist.group.WORLD, torch.zeros(world * 4)
    seen: dict[str, object] = {}
    with mock.patch.dict(os.environ):  # the worker's environment is restored on the way out
        for value in ("0", "1", "auto"):
            os.environ[p2p.ENV_VAR] = value
            seen[value] = p2p.use_p2p("reduce_scatter", pg, full)
        seen["meta"] = p2p.use_p2p("reduce_scatter", pg, torch.zeros(world * 4, device="meta"))
        seen["shared memory"] = shm.channel(pg, 16 // world, full.device) is not None  # every size goes p2p there
        os.environ[p2p.ENV_VAR] = "yes"
        try:
            reduce_scatter_flat(torch.empty(4), full, pg, async_op=False)
        except ValueError as err:
            seen["bad"] = str(err)
    return seen


def test_policy_switch(pool2: WorkerPool) -> None:
    for seen in pool2.run(_policy):
        assert seen["0"] is False and seen["1"] is True and seen["meta"] is False
        assert seen["auto"] is (seen["shared memory"] or p2p.P2P_MIN_BYTES[("reduce_scatter", 2)] <= 16)
        assert "FULLSHARD_GLOO_P2P='yes'" in str(seen["bad"]) and "auto" in str(seen["bad"])


def _uneven(rank: int, world: int) -> str:
    try:
        p2p.pairwise_reduce_scatter(torch.empty(3), torch.empty(7), dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_uneven_input_refused(pool2: WorkerPool) -> None:
    for message in pool2.run(_uneven):
        assert message.startswith("pairwise_reduce_scatter:") and "full (7,)" in message and "2 x" in message


# --- bytes recorded per path -----------------------------------------------------------------------------


def _recorded_bytes(rank: int, world: int) -> dict[str, list[float]]:
    """COMM_STATS after one collective of a 4 KB full buffer, by path: ``[bytes recorded, calls]``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401  (registers backend "fake")

    fake = dist.new_group(list(range(world)), backend="fake")  # stands for NCCL: a native ring reduce-scatter
    full, out, shard = torch.ones(world * 256), torch.empty(256), torch.ones(256)
    seen: dict[str, list[float]] = {}
    with mock.patch.dict(os.environ):
        for setting, pg, name in [("0", dist.group.WORLD, "gloo"), ("1", dist.group.WORLD, "p2p"), ("0", fake, "ring")]:
            os.environ[p2p.ENV_VAR] = setting
            for scratch in (False, True):
                COMM_STATS.reset()
                reduce_scatter_flat(out, full.clone(), pg, async_op=False, scratch_input=scratch)
                seen[f"{name} reduce_scatter scratch={scratch}"] = [
                    COMM_STATS.bytes["reduce_scatter"],
                    COMM_STATS.calls["reduce_scatter"],
                ]
            COMM_STATS.reset()
            all_gather_flat(full, shard, pg, async_op=False)
            seen[f"{name} all_gather"] = [COMM_STATS.bytes["all_gather"], COMM_STATS.calls["all_gather"]]
    return seen


def test_comm_stats_record_what_each_path_moves(pool2: WorkerPool) -> None:
    ring = 4 * 512 * (2 - 1) / 2  # B (n-1)/n for a 4 KB (fp32, 2 x 256) full buffer on 2 ranks
    for seen in pool2.run(_recorded_bytes):
        assert seen == {
            # gloo has no reduce-scatter: its own and the in-place path all-reduce all of the input, twice the bytes
            "gloo reduce_scatter scratch=False": [2 * ring, 1],
            "gloo reduce_scatter scratch=True": [2 * ring, 1],
            "gloo all_gather": [ring, 1],
            # the pairwise exchange sends each peer its chunk: B (n-1)/n, as a ring
            "p2p reduce_scatter scratch=False": [ring, 1],
            "p2p reduce_scatter scratch=True": [ring, 1],
            "p2p all_gather": [ring, 1],
            # any other backend (NCCL) runs its native ring collectives
            "ring reduce_scatter scratch=False": [ring, 1],
            "ring reduce_scatter scratch=True": [ring, 1],
            "ring all_gather": [ring, 1],
        }


# --- training through the engine --------------------------------------------------------------------------


def _run_with(rank: int, world: int, setting: str, spec: TrainSpec, shard: functools.partial) -> RunResult:
    with mock.patch.dict(os.environ, {p2p.ENV_VAR: setting}):
        return run(rank, world, spec, shard)


SPEC = TrainSpec()
FULL_SHARD = functools.partial(wrap_fsdp, strategy="FULL_SHARD")


def test_training_p2p_bitwise_gloo_on_two_ranks(pool2: WorkerPool) -> None:
    native = pool2.run(_run_with, "0", SPEC, FULL_SHARD)
    pairwise = pool2.run(_run_with, "1", SPEC, FULL_SHARD)
    for got, want in zip(pairwise, native, strict=True):
        assert got.losses == want.losses
        assert got.params.keys() == want.params.keys()
        for name, param in want.params.items():
            assert torch.equal(got.params[name], param), name


def test_training_p2p_four_ranks_matches_single_process(pool4: WorkerPool) -> None:
    reference = reference_run(SPEC)
    for result in pool4.run(_run_with, "1", SPEC, FULL_SHARD):
        assert_parity(result, reference)

"""Gradient accumulation that keeps gradient memory sharded: reduce-scatter every micro-batch.

Inside ``no_sync()`` (``FullyShardedDataParallel``) or with ``set_requires_gradient_sync(False)``
(``fully_shard``) a unit keeps its *unsharded* gradient across micro-batches, as torch's FSDP1 and FSDP2 do:
``N`` times the sharded gradient bytes per rank. Leaving synchronisation on instead reduce-scatters each
micro-batch's gradient and adds it into the sharded ``.grad``, so gradient memory stays at 1/N, for
K times the reduce-scatter traffic. Both are checked here: the sharded mode trains exactly like
single-process accumulation of the same micro-batches, and ``no_sync`` holds the full-size buffers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard import FSDP, fully_shard
from fullshard.engine.unit_state import unit_states_in
from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.wrap import ModuleWrapPolicy

CFG = GPTConfig()  # tiny, with sizes that do not divide 2
MICRO, PER_RANK, STEPS = 4, 2, 2


def micro_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global micro-batch (both ranks' rows)."""
    return make_batch(CFG, 2 * PER_RANK, seed=100 * step + micro)


def local_training() -> dict[str, torch.Tensor]:
    """Single process: the same micro-batches, accumulated, one AdamW step per ``MICRO`` of them."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = micro_batch(step, micro)
            (model(x, y) / MICRO).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _wrap(entry: str) -> nn.Module:
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    if entry == "FullyShardedDataParallel":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def sharded_accumulation(rank: int, world: int, entry: str) -> dict[str, object]:
    model = _wrap(entry)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grad_is_shard = []
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = micro_batch(step, micro)
            rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            (model(x[rows], y[rows]) / MICRO).backward()  # gradient sync on: reduced into the sharded .grad
            grad_is_shard.append(
                all(_local(p.grad).shape == _local(p).shape for p in model.parameters() if p.grad is not None)
            )
            unsharded = [s.group.flat_full.grad for s in unit_states_in(model) if s.group is not None]
            grad_is_shard.append(all(g is None for g in unsharded))
        opt.step()
        opt.zero_grad()
    if entry == "FullyShardedDataParallel":
        with FSDP.summon_full_params(model):
            params = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    else:
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "sharded": grad_is_shard}


@pytest.mark.parametrize("entry", ["FullyShardedDataParallel", "fully_shard"])
def test_sharded_accumulation_matches_single_process(pool2: WorkerPool, entry: str) -> None:
    results = pool2.run(sharded_accumulation, entry)
    want = local_training()
    for rank, got in enumerate(results):
        assert all(got["sharded"]), f"rank {rank}: a gradient was held unsharded between micro-batches"
        assert sorted(got["params"]) == sorted(want)
        for name, value in want.items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}")


def no_sync_holds_full_gradients(rank: int, world: int, entry: str) -> list[int]:
    """Bytes of unsharded gradient each rank holds after each unsynchronised micro-batch."""
    model = _wrap(entry)
    off = model.no_sync() if entry == "FullyShardedDataParallel" else None
    if off is None:
        model.set_requires_gradient_sync(False)
    else:
        off.__enter__()
    held = []
    for micro in range(MICRO - 1):
        x, y = micro_batch(0, micro)
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        model(x[rows], y[rows]).backward()
        held.append(
            sum(
                s.group.flat_full.grad.numel() * 4
                for s in unit_states_in(model)
                if s.group is not None and s.group.flat_full.grad is not None
            )
        )
    if off is not None:
        off.__exit__(None, None, None)
    return held


@pytest.mark.parametrize("entry", ["FullyShardedDataParallel", "fully_shard"])
def test_no_sync_keeps_full_size_gradients(pool2: WorkerPool, entry: str) -> None:
    model_bytes = 4 * sum(p.numel() for p in TinyGPT(CFG).parameters())
    for held in pool2.run(no_sync_holds_full_gradients, entry):
        # Padded full blocks: at least the whole model's gradient, per rank, on every micro-batch.
        assert all(h >= model_bytes for h in held), (held, model_bytes)

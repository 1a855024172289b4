"""What a ``fully_shard`` step dispatches around the model's own ops: counts, which do not depend on the machine.

A step whose kernels are short is bound by this CPU work (``benchmarks/dispatch.py`` counts it per system; see
docs/benchmarks.md, "What a step dispatches"). Pinned here:

- the sharded gradients are ``DTensor``s sharing their parameter's spec (built directly, not by ``from_local``);
- with one rank, the cast to ``param_dtype`` is one copy per unit gathered, straight into the gathered buffer;
- backward fills a padding piece with zeros only where a parameter has padding.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fullshard import MixedPrecisionPolicy
from fullshard.testing import WorkerPool
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch
from fullshard.testing.parity import fully_shard_blocks

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def pool1() -> Iterator[WorkerPool]:
    pool = WorkerPool(1)
    yield pool
    pool.close()


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _third_step(rank: int, world: int, bf16: bool) -> dict[str, Any]:
    # - Set up: TinyGPT's odd sizes pad every parameter on 2 ranks, none on 1.
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = fully_shard_blocks(TinyGPT(cfg), **({"mp_policy": BF16} if bf16 else {}))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    # - Run: the third step counted (the first records the order, the second is the steady state's first).
    for i in range(3):
        forward, backward = _OpCount(), _OpCount()
        x, y = make_batch(cfg, 2, i)
        with forward:
            loss = model(x, y)
        with backward:
            loss.backward()
        shares_spec = [p.grad._spec is p._spec for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    padded = sum(1 for p in model.parameters() if p.shape[0] % world)
    return {"fwd": forward.ops, "bwd": backward.ops, "shares_spec": shares_spec, "padded": padded}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_one_rank_casts_once_per_unit_and_fills_no_padding(pool1: WorkerPool, bf16: bool) -> None:
    (got,) = pool1.run(_third_step, bf16)
    units = 3  # two blocks and the root
    assert all(got["shares_spec"])
    assert got["fwd"]["aten._to_copy"] == 0  # no separate send buffer
    assert got["fwd"]["aten.copy_"] == (units if bf16 else 0)  # fp32: the gathered buffer is the shard
    assert got["bwd"]["aten.zeros"] == 0


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_two_ranks_fill_only_padding_that_exists(pool2: WorkerPool, bf16: bool) -> None:
    for got in pool2.run(_third_step, bf16):
        assert all(got["shares_spec"])
        assert got["padded"] > 0
        assert got["bwd"]["aten.zeros"] == got["padded"]

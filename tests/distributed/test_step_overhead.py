"""What a ``fully_shard`` step dispatches around the model's own ops: counts, which do not depend on the machine.

A step whose kernels are short is bound by this CPU work (``benchmarks/dispatch.py`` counts it per system; see
docs/benchmarks.md, "What a step dispatches"). Pinned here:

- the sharded gradients are ``DTensor``s sharing their parameter's spec (built directly, not by ``from_local``);
- with one rank, the cast to ``param_dtype`` is one copy per unit gathered, straight into the gathered buffer;
- backward allocates no zeros for padding (kept zero pieces, see ``full_views.FullViews``);
- the engine's own view ops: one ``as_strided`` per parameter where modules get their views, and per trainable
  parameter in the gradient copy-in and for its sharded gradient; no ``narrow``/``slice`` (the copy-out views are
  kept, ``ParamGroup.full_blocks``), no ``split``; the rank-check header dispatches nothing but its collective.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fullshard import MixedPrecisionPolicy
from fullshard.testing import WorkerPool
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch
from fullshard.testing.parity import fully_shard_blocks

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


ENGINE = os.sep + os.path.join("fullshard", "engine") + os.sep


class _OpCount(TorchDispatchMode):
    """Every op dispatched (``ops``), and those dispatched from the engine's Python code (``engine``: a frame of
    ``fullshard/engine/`` on the stack; autograd's own C++ backward formulas have none)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.engine: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func.overloadpacket)
        self.ops[name] += 1
        frame = sys._getframe(1)
        while frame is not None:
            if ENGINE in frame.f_code.co_filename:
                self.engine[name] += 1
                break
            frame = frame.f_back
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
    return {
        "fwd": forward.ops,
        "bwd": backward.ops,
        "engine_fwd": forward.engine,
        "engine_bwd": backward.engine,
        "shares_spec": shares_spec,
        "padded": padded,
        "params": sum(1 for _ in model.parameters()),
        "root_params": sum(1 for name, _ in model.named_parameters() if not name.startswith("blocks.")),
    }


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_one_rank_casts_once_per_unit_and_fills_no_padding(pool1: WorkerPool, bf16: bool) -> None:
    (got,) = pool1.run(_third_step, bf16)
    units = 3  # two blocks and the root
    assert all(got["shares_spec"])
    assert got["fwd"]["aten._to_copy"] == 0  # no separate send buffer
    assert got["fwd"]["aten.copy_"] == (units if bf16 else 0)  # fp32: the gathered buffer is the shard
    assert got["bwd"]["aten.zeros"] == 0


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_two_ranks_fill_no_padding(pool2: WorkerPool, bf16: bool) -> None:
    for got in pool2.run(_third_step, bf16):
        assert all(got["shares_spec"])
        assert got["padded"] > 0
        assert got["bwd"]["aten.zeros"] == 0  # was one per padded parameter (split's backward)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_two_ranks_one_view_op_per_parameter(pool2: WorkerPool, bf16: bool) -> None:
    units = 3  # the root and two blocks
    for got in pool2.run(_third_step, bf16):
        fwd, bwd, params = got["engine_fwd"], got["engine_bwd"], got["params"]
        # - Check: modules' views, one as_strided per parameter gathered (was a split and a view each).
        assert fwd["aten.as_strided"] == params
        assert fwd["aten.split_with_sizes"] == bwd["aten.split_with_sizes"] == 0
        # - Check: the copy-out writes into kept views (was a narrow, i.e. a slice, and a view per parameter).
        assert fwd["aten.slice"] == bwd["aten.slice"] == 0
        assert fwd["aten.split_with_sizes_copy"] == units
        # - Check, backward: every block parameter's view again (the blocks gathered again), every parameter's
        #   gradient copy-in and sharded gradient. The root's kept gather is not registered again: fully_shard
        #   leaves its gathered tensors registered until it reshards, as torch does; that is one as_strided less
        #   per root parameter than the ninth session's pin (3 * params + units), which main failed (81 against 87
        #   here: FullViews made 22 views in backward, the blocks' parameters only). The reductions go
        #   point-to-point under the rank check (collective_check's note): no as_strided for this rank's chunk
        #   (gloo's all-reduce path took one per reduction, + units).
        assert bwd["aten.as_strided"] == 3 * params - got["root_params"]
        # - Check: the rank-check header builds and reads its buffers without ops (was torch.tensor + tolist).
        assert fwd["aten.lift_fresh"] == bwd["aten.lift_fresh"] == 0

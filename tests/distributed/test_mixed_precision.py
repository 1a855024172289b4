"""Mixed precision: bf16 sharded training equals a single-process run that casts the same way.

Also: the forward sees param_dtype, parameters outside forward stay fp32, the all-gather moves half the
bytes, gradients reduce in reduce_dtype, inputs/outputs/buffers are cast as configured, and batch norm
runs in full precision under an auto-wrap policy.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from fullshard import FSDP, MixedPrecision, MixedPrecisionPolicy, fully_shard
from fullshard.engine.collectives import COMM_STATS
from fullshard.testing import RankFailure, WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.testing.parity import RunResult, TrainSpec, fully_shard_blocks, reference_run, sharded_run
from fullshard.wrap import ModuleWrapPolicy

BF16 = torch.bfloat16


def wrap_fsdp_bf16(model: nn.Module) -> nn.Module:
    mp = MixedPrecision(param_dtype=BF16, reduce_dtype=BF16, buffer_dtype=BF16)
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp)


def wrap_fully_shard_bf16(model: nn.Module) -> nn.Module:
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    return fully_shard_blocks(model, mp_policy=policy)


def _run(rank: int, world: int, spec: TrainSpec, shard: object) -> RunResult:
    return sharded_run(rank, world, spec, shard)


SPEC = TrainSpec(optimizer="sgd", lr=0.1, compute_dtype=BF16, steps=4)


@pytest.mark.parametrize("shard", [wrap_fsdp_bf16, wrap_fully_shard_bf16], ids=["fsdp", "fully_shard"])
def test_bf16_matches_reference_that_casts_the_same_way(pool2: WorkerPool, shard: object) -> None:
    want = reference_run(SPEC)
    for got in pool2.run(_run, SPEC, shard):
        # bf16 holds ~3 significant digits: a loss near 3.8 is quantized in steps of 1/64.
        torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), atol=2e-2, rtol=1e-2)
        for name, ref in want.params.items():
            assert got.params[name].dtype == torch.float32, name
            torch.testing.assert_close(got.params[name], ref, atol=5e-4, rtol=1e-2, msg=name)


def _dtypes_seen(rank: int, world: int, entry: str) -> dict[str, object]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig())
    seen: dict[str, object] = {}
    model.blocks[0].fc.register_forward_pre_hook(
        lambda m, args: seen.update(weight=m.weight.dtype, input=args[0].dtype)
    )
    shard = wrap_fsdp_bf16 if entry == "fsdp" else wrap_fully_shard_bf16
    model = shard(model)
    x, y = make_batch(model.cfg if entry == "fsdp" else GPTConfig(), 2, 0)
    COMM_STATS.reset()
    loss = model(x, y)
    gathered_bf16 = COMM_STATS.bytes["all_gather"]
    loss.backward()
    seen["loss"] = loss.dtype
    seen["reduced"] = COMM_STATS.bytes["reduce_scatter"]
    seen["params_after"] = {p.dtype for p in model.parameters()}
    seen["grads_after"] = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    seen["gathered_bf16"] = gathered_bf16
    return seen


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_forward_sees_param_dtype_and_parameters_stay_fp32(pool2: WorkerPool, entry: str) -> None:
    seen = pool2.run(_dtypes_seen, entry)[0]
    assert seen["weight"] == BF16
    assert seen["input"] == BF16  # activations flow in bf16
    assert seen["params_after"] == {torch.float32}
    assert seen["grads_after"] == {torch.float32}
    model_bytes_fp32 = sum(p.numel() * 4 for p in TinyGPT(GPTConfig()).parameters())
    # One all-gather of everything in forward, in bf16: half of fp32's (N-1)/N share.
    assert seen["gathered_bf16"] == pytest.approx(model_bytes_fp32 / 2 / 2, rel=0.05)
    # The reductions go point-to-point under the rank check (on by default, see collective_check's note): the
    # (N-1)/N share of the gradient, in bf16 like the gather (gloo's own path, an all-reduce, would move twice that).
    assert seen["reduced"] == pytest.approx(model_bytes_fp32 / 2 / 2, rel=0.05)


def _reduce_dtype_and_low_grads(rank: int, world: int, keep_low: bool) -> dict[str, object]:
    torch.manual_seed(0)
    reduce = BF16 if keep_low else torch.float32
    mp = MixedPrecision(param_dtype=BF16, reduce_dtype=reduce, keep_low_precision_grads=keep_low)
    model = FSDP(TinyGPT(GPTConfig()), auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp)
    x, y = make_batch(GPTConfig(), 2, 0)
    COMM_STATS.reset()
    model(x, y).backward()
    return {"reduced": COMM_STATS.bytes["reduce_scatter"], "grads": {p.grad.dtype for p in model.parameters()}}


@pytest.mark.parametrize("keep_low", [False, True])
def test_reduce_dtype_and_keep_low_precision_grads(pool2: WorkerPool, keep_low: bool) -> None:
    got = pool2.run(_reduce_dtype_and_low_grads, keep_low)[0]
    model_bytes_fp32 = sum(p.numel() * 4 for p in TinyGPT(GPTConfig()).parameters())
    # The reduce-scatter moves (N-1)/N of the gradient bytes in reduce_dtype (point-to-point under the rank
    # check, on by default; gloo's own path, an all-reduce of the whole gradient, would move twice that).
    expected = model_bytes_fp32 / 2 / (2 if keep_low else 1)
    assert got["reduced"] == pytest.approx(expected, rel=0.05)
    assert got["grads"] == ({BF16} if keep_low else {torch.float32})


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.inp(x)))


def _batch_norm_full_precision(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    net = NormNet()
    seen: dict[str, object] = {}
    net.norm.register_forward_pre_hook(lambda m, a: seen.update(norm_in=a[0].dtype, norm_w=m.weight.dtype))
    net.out.register_forward_pre_hook(lambda m, a: seen.update(out_in=a[0].dtype, root_in=None))
    net.inp.register_forward_pre_hook(lambda m, a: seen.update(inp_in=a[0].dtype))
    mp = MixedPrecision(param_dtype=BF16)
    model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), mixed_precision=mp)
    out = model(torch.randn(4, 6))
    seen["out"] = out.dtype
    seen["running_mean"] = net.norm.module.running_mean.dtype if hasattr(net.norm, "module") else None
    return seen


def test_batch_norm_runs_in_full_precision(pool2: WorkerPool) -> None:
    seen = pool2.run(_batch_norm_full_precision)[0]
    assert seen["inp_in"] == BF16  # the root casts its float inputs
    assert seen["norm_in"] == torch.float32
    assert seen["norm_w"] == torch.float32
    assert seen["out_in"] == BF16
    assert seen["running_mean"] == torch.float32


def _output_dtype(rank: int, world: int) -> str:
    layer = fully_shard(nn.Linear(4, 4), mp_policy=MixedPrecisionPolicy(param_dtype=BF16, output_dtype=torch.float32))
    return str(layer(torch.randn(2, 4)).dtype)


def test_fully_shard_output_dtype(pool2: WorkerPool) -> None:
    assert pool2.run(_output_dtype) == ["torch.float32", "torch.float32"]


def _bad_dtype(rank: int, world: int, which: str) -> None:
    if which == "mp":
        FSDP(nn.Linear(2, 2), mixed_precision=MixedPrecision(param_dtype=torch.int8))
    else:
        fully_shard(nn.Linear(2, 2), mp_policy=MixedPrecisionPolicy(reduce_dtype="bf16"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("which", "message"),
    [
        ("mp", "MixedPrecision(param_dtype=torch.int8): param_dtype must be a floating-point torch.dtype"),
        ("policy", "MixedPrecisionPolicy(reduce_dtype='bf16'): reduce_dtype must be a floating-point torch.dtype"),
    ],
)
def test_bad_dtypes_are_named(pool2: WorkerPool, which: str, message: str) -> None:
    with pytest.raises(RankFailure, match=re.escape(message)):
        pool2.run(_bad_dtype, which)


def _reduce_without_param(rank: int, world: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDP(nn.Linear(2, 2), mixed_precision=MixedPrecision(reduce_dtype=torch.float64))
        FSDP(nn.Linear(2, 2), mixed_precision=MixedPrecision(keep_low_precision_grads=True))
    return [str(w.message) for w in caught]


def test_meaningless_combinations_warn(pool2: WorkerPool) -> None:
    messages = pool2.run(_reduce_without_param)[0]
    assert any(m.startswith("reduce_dtype=torch.float64 without param_dtype reduces") for m in messages)
    assert any(m.startswith("MixedPrecision(keep_low_precision_grads=True) has no effect") for m in messages)

"""World-size-invariant mode (issue 27 §1): for a fixed global batch cut into G micro-batches, the weights after
AdamW steps are bitwise equal (``torch.equal``) on 1, 2 and 4 ranks, with accumulation (G/N micro-batches per
rank) and with gradient clipping, in float32, bf16 mixed precision and bf16 parameters; see [Note: world-size
invariance] in ``engine/invariant.py``.

Every case of one world size runs in one pool call (the training is tiny); the 1-rank world is a pool of its own.
"""

from __future__ import annotations

import contextlib
import re
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fullshard import FSDP, MixedPrecision, MixedPrecisionPolicy, fully_shard
from fullshard.engine.api import ShardingStrategy
from fullshard.engine.invariant import PIECE, TreeSum, resolve, tree_sum_rows
from fullshard.testing import RankFailure, WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.wrap import ModuleWrapPolicy

# Odd sizes (no dim 0 divides 2 or 4); n_embd 40 makes the MLP weights (161 x 40) span several norm pieces.
CFG = GPTConfig(n_embd=40, n_head=4)
MICRO_ROWS, STEPS, MAX_NORM = 2, 3, 0.05

# (name, entry, strategy, G, clip[, precision]): precision is a key of PRECISIONS, float32 when left out
CASES = [
    ("fsdp-full-G4", "fsdp", "FULL_SHARD", 4, False),
    ("fsdp-full-G4-clip", "fsdp", "FULL_SHARD", 4, True),
    ("fsdp-grad-op-G4", "fsdp", "SHARD_GRAD_OP", 4, False),
    ("fsdp-grad-op-G4-clip", "fsdp", "SHARD_GRAD_OP", 4, True),
    ("fully-shard-G4", "fully_shard", None, 4, False),
    ("fully-shard-G4-clip", "fully_shard", None, 4, True),
    ("fully-shard-G8-clip", "fully_shard", None, 8, True),  # 4 ranks accumulate too
    ("fsdp-hybrid-G4-clip", "fsdp", "HYBRID_SHARD", 4, True),
    ("fsdp-no-shard-G4-clip", "fsdp", "NO_SHARD", 4, True),
    ("fsdp-full-G8-no_sync", "fsdp", "FULL_SHARD", 8, False),  # no_sync() around all but a rank's last micro-batch
]


BF16 = torch.bfloat16
# precision -> (reduce_dtype of a bf16 mixed precision policy, or None: bf16 parameters, no policy)
PRECISIONS = {"mp-bf16-reduce-f32": torch.float32, "mp-bf16-reduce-bf16": BF16, "bf16-params": None}

BF16_CASES = [
    ("fsdp-full-G4-clip-mp-f32", "fsdp", "FULL_SHARD", 4, True, "mp-bf16-reduce-f32"),
    ("fsdp-full-G4-clip-mp-bf16", "fsdp", "FULL_SHARD", 4, True, "mp-bf16-reduce-bf16"),
    ("fsdp-grad-op-G8-clip-mp-bf16", "fsdp", "SHARD_GRAD_OP", 8, True, "mp-bf16-reduce-bf16"),
    ("fsdp-hybrid-G4-clip-mp-bf16", "fsdp", "HYBRID_SHARD", 4, True, "mp-bf16-reduce-bf16"),
    ("fully-shard-G8-clip-mp-f32", "fully_shard", None, 8, True, "mp-bf16-reduce-f32"),
    ("fully-shard-G8-clip-mp-bf16", "fully_shard", None, 8, True, "mp-bf16-reduce-bf16"),
    ("fsdp-full-G4-clip-bf16-params", "fsdp", "FULL_SHARD", 4, True, "bf16-params"),
    ("fsdp-grad-op-G4-clip-bf16-params", "fsdp", "SHARD_GRAD_OP", 4, True, "bf16-params"),
    ("fsdp-hybrid-G8-clip-bf16-params", "fsdp", "HYBRID_SHARD", 8, True, "bf16-params"),
    ("fully-shard-G8-clip-bf16-params", "fully_shard", None, 8, True, "bf16-params"),
]


def _build(entry: str, strategy: str | None, micro_batches: int, world: int, precision: str = "f32") -> nn.Module:
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    reduce_dtype = PRECISIONS.get(precision)
    if precision == "bf16-params":
        model.to(BF16)
    if entry == "fully_shard":
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype) if reduce_dtype else None
        for block in model.blocks:
            fully_shard(block, invariant_micro_batches=micro_batches, mp_policy=policy)
        return fully_shard(model, invariant_micro_batches=micro_batches, mp_policy=policy)
    kwargs = {}
    if strategy == "HYBRID_SHARD":  # (replicate, shard): 1 -> (1, 1), 2 -> (2, 1), 4 -> (2, 2)
        kwargs["device_mesh"] = init_device_mesh("cpu", (min(world, 2), max(1, world // 2)))
    if reduce_dtype is not None:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=BF16, reduce_dtype=reduce_dtype, buffer_dtype=BF16)
    return FSDP(
        model,
        sharding_strategy=ShardingStrategy[strategy or "FULL_SHARD"],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        invariant_micro_batches=micro_batches,
        **kwargs,
    )


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def train_cases(rank: int, world: int, cases: list[tuple]) -> dict[str, object]:
    results: dict[str, object] = {}
    for name, entry, strategy, micro_batches, clip, *precision in cases:
        model = _build(entry, strategy, micro_batches, world, *precision)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        per_rank = micro_batches // world
        norms, references = [], []
        for step in range(STEPS):
            x, y = make_batch(CFG, micro_batches * MICRO_ROWS, seed=1000 + step)  # the global batch
            for k in range(per_rank):  # this rank's consecutive micro-batches, accumulated by the engine
                rows = slice((rank * per_rank + k) * MICRO_ROWS, (rank * per_rank + k + 1) * MICRO_ROWS)
                skip_sync = name.endswith("no_sync") and k < per_rank - 1
                with model.no_sync() if skip_sync else contextlib.nullcontext():
                    (model(x[rows], y[rows]) / per_rank).backward()
            if clip:
                if entry == "fully_shard":  # the plain norm of the full gradients, to check the value
                    full = [p.grad.full_tensor().double().reshape(-1) for p in model.parameters()]
                    references.append(float(torch.linalg.vector_norm(torch.cat(full))))
                norms.append(model.clip_grad_norm_(MAX_NORM))
            dtypes = {(p.dtype, p.grad.dtype) for p in model.parameters()}  # (parameter, gradient)
            opt.step()
            opt.zero_grad()
        results[name] = {"params": _full_params(model), "norms": norms, "references": references, "dtypes": dtypes}
    return results


@pytest.fixture(scope="module")
def runs(pool1: WorkerPool, pool2: WorkerPool, pool4: WorkerPool) -> dict[int, list[dict[str, object]]]:
    cases = CASES + BF16_CASES
    return {n: pool.run(train_cases, cases) for n, pool in ((1, pool1), (2, pool2), (4, pool4))}


def _check_bitwise_equal(runs: dict[int, list[dict[str, object]]], case: str) -> None:
    want = runs[1][0][case]
    clip = next(c[4] for c in CASES + BF16_CASES if c[0] == case)
    if clip:  # the clipping coefficient was below 1 at every step, so clipping changed the gradients
        assert all(float(n) > MAX_NORM for n in want["norms"]), want["norms"]
        for norm, reference in zip(want["norms"], want["references"]):  # fully_shard cases
            assert float(norm) == pytest.approx(reference, rel=1e-6)
    for world, results in runs.items():
        for rank, result in enumerate(results):
            got = result[case]
            assert sorted(got["params"]) == sorted(want["params"])
            for name, value in want["params"].items():
                assert torch.equal(got["params"][name], value), f"{case}: {world} ranks, rank {rank}: {name} differs"
            for a, b in zip(got["norms"], want["norms"], strict=True):
                assert torch.equal(a, b), f"{case}: {world} ranks, rank {rank}: norm {a} != {b}"


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_weights_bitwise_equal_on_1_2_4_ranks(runs: dict[int, list[dict[str, object]]], case: str) -> None:
    _check_bitwise_equal(runs, case)


# On 8 ranks (every rank one micro-batch of G = 8): the cases of G = 8, against the 1-rank run.
EIGHT = [
    "fully-shard-G8-clip",
    "fsdp-full-G8-no_sync",
    "fully-shard-G8-clip-mp-bf16",
    "fsdp-hybrid-G8-clip-bf16-params",
]


def test_weights_bitwise_equal_on_8_ranks(runs: dict[int, list[dict[str, object]]]) -> None:
    """8 gloo ranks on this 2-core machine (about 15 s to start): hybrid sharding on a (2, 4) mesh."""
    cases = [c for c in CASES + BF16_CASES if c[0] in EIGHT]
    assert len(cases) == len(EIGHT)
    pool = WorkerPool(8)
    try:
        eight = pool.run(train_cases, cases)
    finally:
        pool.close()
    for case in EIGHT:
        _check_bitwise_equal({1: runs[1], 8: eight}, case)


@pytest.mark.parametrize("case", [c[0] for c in BF16_CASES])
def test_bf16_weights_bitwise_equal_on_1_2_4_ranks(runs: dict[int, list[dict[str, object]]], case: str) -> None:
    """bf16 compute (mixed precision) or bf16 parameters: the tree's float32 partial sums are rounded once, into the
    sharded gradient (float32 under a policy, bf16 for bf16 parameters)."""
    _check_bitwise_equal(runs, case)
    dtype = BF16 if case.endswith("bf16-params") else torch.float32
    for results in runs.values():
        for result in results:
            assert result[case]["dtypes"] == {(dtype, dtype)}, result[case]["dtypes"]


@pytest.mark.parametrize(
    "f32, bf16",
    [
        ("fsdp-full-G4-clip-mp-f32", "fsdp-full-G4-clip-mp-bf16"),
        ("fully-shard-G8-clip-mp-f32", "fully-shard-G8-clip-mp-bf16"),
    ],
)
def test_bf16_reduce_dtype_sums_in_float32(runs: dict[int, list[dict[str, object]]], f32: str, bf16: str) -> None:
    """reduce_dtype=bfloat16 gives the same bits as float32 in invariant mode: the partial sums are float32 either
    way (one rounding, none for float32 gradients). The bf16 compute itself shows: not the float32 run's weights."""
    for results in runs.values():
        for result in results:
            for name, value in result[f32]["params"].items():
                assert torch.equal(result[bf16]["params"][name], value), name
    fp32_run = runs[1][0]["fsdp-full-G4-clip" if f32.startswith("fsdp") else "fully-shard-G8-clip"]
    assert any(not torch.equal(v, fp32_run["params"][n]) for n, v in runs[1][0][f32]["params"].items())


def test_tree_sum_matches_across_splits() -> None:
    """The stack of one rank's micro-batches, then the tree over ranks' partials: the same bits for every split."""
    torch.manual_seed(0)
    grads = [torch.randn(1000) * 10 ** float(i % 5) for i in range(8)]
    results = []
    for ranks in (1, 2, 4, 8):
        partials = []
        for r in range(ranks):
            tree = TreeSum()
            for g in grads[r * 8 // ranks : (r + 1) * 8 // ranks]:
                tree.push(g.clone())
            partials.append(tree.take())
        results.append(tree_sum_rows(torch.stack(partials)))
    assert all(torch.equal(r, results[0]) for r in results)
    assert not torch.equal(results[0], sum(grads[1:], grads[0].clone()))  # a left fold rounds differently here


def test_refusals(pool2: WorkerPool, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="power of two"):
        resolve(3, "fully_shard")
    monkeypatch.setenv("FULLSHARD_INVARIANT_MICRO_BATCHES", "6")
    with pytest.raises(ValueError, match="FULLSHARD_INVARIANT_MICRO_BATCHES='6'"):
        resolve(None, "fully_shard")
    monkeypatch.setenv("FULLSHARD_INVARIANT_MICRO_BATCHES", "0")
    assert resolve(None, "fully_shard") is None
    with pytest.raises(RankFailure, match="not a multiple of the data-parallel size 2"):
        pool2.run(_wrap_with, 1)
    assert PIECE & (PIECE - 1) == 0


def _wrap_with(rank: int, world: int, micro_batches: int) -> None:
    fully_shard(TinyGPT(CFG), invariant_micro_batches=micro_batches)


def _misuse(rank: int, world: int, what: str) -> None:
    """G=8 on 2 ranks: 4 micro-batches per rank per step."""
    model = fully_shard(TinyGPT(CFG), invariant_micro_batches=None if what == "mixed" and rank else 8)
    x, y = make_batch(CFG, 2, seed=0)
    if what == "mixed":
        model(x, y)
    for k in range(4):
        model.set_requires_gradient_sync(what != "no_sync on the last" or k < 3)
        model(x, y).backward()
        if what == "clip early" and k == 2:
            model.clip_grad_norm_(1.0)


@pytest.mark.parametrize(
    "what, message",
    [
        ("clip early", "3 micro-batches of unit .* folded but not reduced"),
        ("no_sync on the last", "micro-batch 4 of 4 on this rank ran with gradient sync off"),
        ("mixed", "invariant_micro_batches=8"),
    ],
)
def test_misuse_is_refused(pool2: WorkerPool, what: str, message: str) -> None:
    with pytest.raises(RankFailure, match=message):
        pool2.run(_misuse, what)


def _build_f16_or_f64(rank: int, world: int, how: str) -> None:
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    if how == "fully_shard-policy-f16":
        fully_shard(model, invariant_micro_batches=2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    elif how == "fsdp-reduce-f16":
        FSDP(model, invariant_micro_batches=2, mixed_precision=MixedPrecision(reduce_dtype=torch.float16))
    else:
        FSDP(model.to(torch.float16 if how == "fsdp-f16-params" else torch.float64), invariant_micro_batches=2)


@pytest.mark.parametrize(
    "how, message",
    [
        (
            "fully_shard-policy-f16",
            "refuses float16 compute (got param_dtype torch.float16, reduce_dtype torch.float16)",
        ),
        ("fsdp-f16-params", "refuses float16 compute (got the parameters' dtype torch.float16, param_dtype"),
        ("fsdp-reduce-f16", "supports float32 and bfloat16 only (got reduce_dtype torch.float16)"),
        ("fsdp-f64-params", "supports float32 and bfloat16 only (got the parameters' dtype torch.float64, param_dtype"),
    ],
)
def test_dtype_refusals_name_the_value_and_the_fix(pool2: WorkerPool, how: str, message: str) -> None:
    with pytest.raises(RankFailure, match=re.escape(message)) as failure:
        pool2.run(_build_f16_or_f64, how)
    fix = "Use torch.bfloat16 instead" if "compute" in message else "cast the model to torch.float32 or torch.bfloat16"
    assert fix in str(failure.value) and "or drop invariant_micro_batches" in str(failure.value)


def _default_mode_and_ddp(rank: int, world: int, entry: str) -> list[str]:
    """Default mode (no invariant_micro_batches), 3 micro-batches per rank with gradient sync off for the first two
    (a left fold, which no tree equals), against torch's DDP doing the same: the names of the parameters that differ
    after three AdamW steps. Every function of invariant.py that does the mode's work raises if called: the default
    mode's step never enters it (one ``is None`` test per hook is all the mode adds to it)."""

    def entered(*args: object, **kwargs: object) -> None:
        raise AssertionError("the default mode called into engine/invariant.py")

    from fullshard.engine import invariant

    work = ("fold_backward", "fold_leftovers", "total_norm", "check_ready_to_clip", "validate_group")
    with mock.patch.multiple(invariant, **dict.fromkeys(work, entered)):
        return _default_mode_against_ddp(rank, world, entry)


def _default_mode_against_ddp(rank: int, world: int, entry: str) -> list[str]:
    models = []
    for wrap in ("ddp", entry):
        torch.manual_seed(0)
        model = TinyGPT(CFG)
        if wrap == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        elif wrap == "fully_shard":
            for block in model.blocks:
                fully_shard(block)
            model = fully_shard(model)
        else:
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(STEPS):
            x, y = make_batch(CFG, 3 * world * MICRO_ROWS, seed=1000 + step)
            for k in range(3):
                rows = slice((rank * 3 + k) * MICRO_ROWS, (rank * 3 + k + 1) * MICRO_ROWS)
                if wrap == "fully_shard":
                    model.set_requires_gradient_sync(k == 2)
                with model.no_sync() if k < 2 and wrap != "fully_shard" else contextlib.nullcontext():
                    (model(x[rows], y[rows]) / 3).backward()
            if wrap != "ddp":
                model.clip_grad_norm_(1e6)  # the default mode's norm (the clip itself changes nothing)
            opt.step()
            opt.zero_grad()
        models.append(model.module if wrap == "ddp" else model)
    want, got = (_full_params(m) for m in models)
    return [name for name, value in want.items() if not torch.equal(got[name], value)]


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_default_mode_unchanged_bitwise_ddp(pool2: WorkerPool, entry: str) -> None:
    """The default mode keeps its own reduction (a reduce-scatter per step, bf16 reduce_dtype on the wire: see
    test_mixed_precision.py): on 2 ranks it is bitwise torch's DDP, as before invariant mode existed."""
    assert pool2.run(_default_mode_and_ddp, entry) == [[], []]

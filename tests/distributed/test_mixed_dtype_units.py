"""A unit that holds parameters of two dtypes: a frozen bf16 base with fp32 LoRA-style adapters, computing in bf16.

Set up: blocks of a frozen bf16 ``base`` Linear (odd sizes: uneven shards, padding) with fp32 adapters ``a`` and
``b`` (trainable) in the same unit, and a trainable fp32 head; a bf16 compute policy reducing in fp32.
Run: 3 AdamW steps, each rank its half of the batch, under ``fully_shard`` and the FSDP class (2 gloo ranks); the same
model unsharded in one process, computing with bf16 casts of its parameters (what the policy means); and the same
model under torch's ``fully_shard``, which shards each dtype (2 gloo ranks).
Check: losses and trained adapters equal the reference and torch's within bf16 compute rounding; the base stays bf16
and bitwise unchanged, its shards held in bf16 (a unit's shard bytes are each parameter's own); gradients and
optimizer state exist for the fp32 trainable parameters only, in fp32; a full state dict gives every parameter in its
own dtype. Without a compute dtype a mixed unit is refused, naming the fixes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from fullshard.testing import WorkerPool

DIM, RANK, STEPS = 13, 3, 3


class Adapted(nn.Module):
    """A frozen bf16 linear with a trainable fp32 low-rank update (LoRA's shape, without PEFT)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, DIM).to(torch.bfloat16).requires_grad_(False)
        self.a = nn.Linear(DIM, RANK, bias=False)
        self.b = nn.Linear(RANK, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.base(x) + self.b(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(Adapted(), Adapted())
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, DIM, generator=torch.Generator().manual_seed(50 + step))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _reference() -> dict[str, Any]:
    model = Net()
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW([p for p in params.values() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        cast = {k: v.to(torch.bfloat16) for k, v in params.items()}
        loss = _loss(torch.func.functional_call(model, cast, (_batch(step).to(torch.bfloat16),)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def mixed_run(rank: int, world: int, entry: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    model = Net()
    base0 = {k: v.detach().clone() for k, v in model.state_dict().items() if "base" in k}
    if entry == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        policy = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            torch_fully_shard(block, mp_policy=policy)
        torch_fully_shard(model, mp_policy=policy)
    elif entry.startswith("fully_shard"):
        from fullshard import MixedPrecisionPolicy, fully_shard
        from fullshard.algorithms.checkpointing import checkpoint_module
        from fullshard.engine import group as group_module

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        direct_min = group_module.DIRECT_MIN_BYTES
        if entry.endswith("direct"):  # the base weight (182 gathered elements) and `a` (52) gathered on their own
            group_module.DIRECT_MIN_BYTES = 50 * 2
        try:
            for block in model.blocks:
                if entry.endswith("+AC"):  # recomputed in backward: the views are registered again from the same leaf
                    checkpoint_module(block)
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        finally:
            group_module.DIRECT_MIN_BYTES = direct_min
    else:
        from fullshard import FSDP, MixedPrecision
        from fullshard.wrap import ModuleWrapPolicy

        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Adapted}), mixed_precision=mp, use_orig_params=True)
    sent_in_place = _direct_bf16_sent_in_place(model) if entry.endswith("direct") else None
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        x = _batch(step)[rank * 4 : (rank + 1) * 4]
        loss = _loss(model(x))
        loss.backward()
        if step == STEPS - 1:
            grads = {(p.dtype, p.grad is not None) for p in model.parameters()}
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    state_tensors = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    if entry == "fsdp1":
        from fullshard import FSDP, FullStateDictConfig, StateDictType

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
            state = model.state_dict()
        local_base = {k: v for k, v in dict(model.named_parameters()).items() if "base" in k}
    else:
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        local_base = {k: v.to_local() for k, v in model.named_parameters() if "base" in k}
    state = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone() for k, v in state.items()}
    return {
        "losses": losses,
        "state": state,
        "base_unchanged": all(torch.equal(state[k], v) for k, v in base0.items()),
        "grads": grads,
        "state_dtypes": {t.dtype for t in state_tensors},
        "local_base_dtypes": {t.dtype for t in local_base.values()},
        "sent_in_place": sent_in_place,
    }


def _direct_bf16_sent_in_place(model: nn.Module) -> list[tuple[str, torch.dtype, bool]]:
    """Per parameter a block's gather sends on its own: its dtype, and whether what it sends lies in the unit's
    flat shard (no copy) rather than in a buffer of its own."""
    from fullshard.engine.unit_state import unit_state

    seen = []
    for block in model.blocks:
        group = unit_state(block).group
        _, pieces = group._send_pieces()
        shard_storage = group.flat_shard.untyped_storage().data_ptr()
        for sp, piece in zip(group.direct, pieces):
            seen.append((sp.fqn.rsplit(".", 2)[-2], sp.dtype, piece.untyped_storage().data_ptr() == shard_storage))
    return seen


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return _reference()


@pytest.fixture(scope="module")
def torch_run(pool2: WorkerPool) -> dict[str, Any]:
    return pool2.run(mixed_run, "torch")[0]


@pytest.mark.parametrize("entry", ["fully_shard", "fully_shard+AC", "fsdp1", "fully_shard, direct"])
def test_bf16_frozen_base_and_fp32_adapters_in_one_unit(
    pool2: WorkerPool, entry: str, reference: dict[str, Any], torch_run: dict[str, Any]
) -> None:
    result = pool2.run(mixed_run, entry)[0]
    if entry.endswith("direct"):
        # gathered on their own (as every large weight is): the frozen bf16 base is sent from its shard, not
        # copied for each gather; the fp32 adapter is cast to bf16 into a buffer of its own
        assert result["sent_in_place"] == [("a", torch.float32, False), ("base", torch.bfloat16, True)] * 2
    assert result["base_unchanged"]
    assert result["local_base_dtypes"] == {torch.bfloat16}  # the frozen shards are not upcast
    # gradients: the fp32 trainable parameters only; the frozen bf16 base has none
    assert result["grads"] == {(torch.float32, True), (torch.bfloat16, False)}
    assert result["state_dtypes"] == {torch.float32}  # AdamW state for the fp32 adapters only
    # against torch's FSDP2 (the same bf16 casts, the same fp32 sums): fp32 tolerance; against one process, whose
    # bf16 gradients are not summed across ranks: bf16 rounding of the gradient (seen: 7e-5; each step moves 1e-2)
    for other, atol, rel in ((torch_run, 1e-5, 1e-6), (reference, 5e-4, 1e-3)):
        assert result["losses"] == pytest.approx(other["losses"], rel=rel)
        for key, value in other["state"].items():
            got = result["state"][key]
            assert got.dtype == value.dtype, key  # every parameter in its own dtype
            torch.testing.assert_close(got, value, atol=atol, rtol=0, msg=key)


def refused_without_compute_dtype(rank: int, world: int) -> str:
    from fullshard import fully_shard

    model = Net()
    try:
        fully_shard(model.blocks[0])
    except ValueError as err:
        return str(err)
    return "not refused"


def test_mixed_unit_without_compute_dtype_is_refused(pool2: WorkerPool) -> None:
    messages = pool2.run(refused_without_compute_dtype)
    for message in messages:  # every rank
        assert "mixes parameter dtypes" in message and "param_dtype" in message, message


def frozen_costs(rank: int, world: int, entry: str) -> dict[str, Any]:
    """One step of an ``Adapted`` block with an fp32 base (frozen), recording the unsharded gradient each unit gets
    and the bytes reduce-scattered."""
    from fullshard import FSDP, fully_shard
    from fullshard.engine.collectives import COMM_STATS
    from fullshard.engine.group import ParamGroup

    torch.manual_seed(0)
    model = Adapted()
    model.base.float()
    if entry == "fully_shard":
        fully_shard(model)
    else:
        model = FSDP(model, use_orig_params=True)
    seen: list[int] = []
    take = ParamGroup.take_unsharded_grad

    def recording(group: ParamGroup, dtype: torch.dtype | None = None) -> torch.Tensor:
        grad = take(group, dtype)
        seen.append(grad.numel())
        return grad

    ParamGroup.take_unsharded_grad = recording  # type: ignore[method-assign]
    try:
        COMM_STATS.reset()
        model(torch.randn(4, DIM)).sum().backward()
    finally:
        ParamGroup.take_unsharded_grad = take  # type: ignore[method-assign]
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {
        "unsharded": seen,
        "reduced_bytes": COMM_STATS.bytes["reduce_scatter"],
        "grads": [p.grad is not None for p in model.parameters()],
        "trainable_numel": sum(p.numel() for p in trainable),
    }


@pytest.mark.parametrize("entry", ["fully_shard", "fsdp1"])
def test_frozen_parameters_cost_no_unsharded_gradient(pool2: WorkerPool, entry: str) -> None:
    # a: 3x13 and b: 13x3 fp32, padded to 2 rows per rank and 7 rows per rank: 2 * (2*13 + 7*3) = 94 elements;
    # the frozen 13x13 base and its bias (2 * (7*13 + 7) = 196 more) get none (they did: zeros, then one cat)
    result = pool2.run(frozen_costs, entry)[0]
    assert result["unsharded"] == [94]
    # (N-1)/N of the reduce-scatter input, the trainable blocks only, fp32 (point-to-point under the rank check)
    assert result["reduced_bytes"] == 94 * 4 / 2
    assert result["grads"].count(True) == 2


def quantized_base(rank: int, world: int, entry: str, ignore: bool) -> tuple[str, float]:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from fullshard import FSDP, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 4))
    model[0].weight = nn.Parameter(to_nf4(model[0].weight.detach().to(torch.bfloat16), 64, 8), requires_grad=False)
    model[1].to(torch.bfloat16)
    ignored = {model[0].weight} if ignore else set()
    try:
        if entry == "fully_shard":
            fully_shard(model, ignored_params=ignored or None)
        else:
            model = FSDP(model, use_orig_params=True, ignored_states=list(ignored) or None)
    except ValueError as err:
        return str(err), 0.0
    return "sharded", model(torch.ones(2, 64, dtype=torch.bfloat16)).float().sum().item()


@pytest.mark.parametrize("entry", ["fully_shard", "fsdp1"])
def test_4bit_base_sharded_or_left_unsharded_computes_the_same(pool2: WorkerPool, entry: str) -> None:
    # QLoRA: torchao's NF4Tensor is sharded through its all-gather protocol (codes and block scales split by rows,
    # see engine/extension.py), or left unsharded when ignored; both compute what one process does, bitwise (the
    # gathered codes are the original ones). It was refused by name before.
    pytest.importorskip("torchao")
    sharded = pool2.run(quantized_base, entry, False)
    ignored = pool2.run(quantized_base, entry, True)
    assert [r[0] for r in sharded + ignored] == ["sharded"] * 4
    assert len({r[1] for r in sharded + ignored}) == 1 and math.isfinite(sharded[0][1])


def state_and_unfreeze(rank: int, world: int, entry: str) -> dict[str, Any]:
    """A trained mixed unit's state dict loads into a fresh one (sharded state dict for fully_shard, the local flat
    shard for the FSDP class), and unfreezing the bf16 base after sharding is refused by name."""
    from fullshard import FSDP, MixedPrecision, MixedPrecisionPolicy, StateDictType, fully_shard

    def build() -> nn.Module:
        model = Adapted()
        if entry == "fully_shard":
            return fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        return FSDP(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), use_orig_params=True)

    def state(model: nn.Module) -> dict[str, torch.Tensor]:
        if entry == "fully_shard":
            return {k: v.to_local().clone() for k, v in model.state_dict().items()}
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            return {
                k: v.to_local().clone() if hasattr(v, "to_local") else v.clone() for k, v in model.state_dict().items()
            }

    trained = build()
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.add_(1.0)
    saved = trained.state_dict() if entry == "fully_shard" else None
    if entry == "fsdp1":
        with FSDP.state_dict_type(trained, StateDictType.LOCAL_STATE_DICT):
            saved = trained.state_dict()
    torch.manual_seed(rank + 7)
    fresh = build()
    if entry == "fsdp1":
        with FSDP.state_dict_type(fresh, StateDictType.LOCAL_STATE_DICT):
            fresh.load_state_dict(saved)
    else:
        fresh.load_state_dict(saved)
    a, b = state(trained), state(fresh)
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    for p in fresh.parameters():
        p.requires_grad_(True)
    try:
        fresh(torch.randn(2, DIM))
        refusal = "not refused"
    except ValueError as err:
        refusal = str(err)
    return {"equal": equal, "refusal": refusal}


@pytest.mark.parametrize("entry", ["fully_shard", "fsdp1"])
def test_mixed_unit_state_dict_round_trip_and_unfreeze_refused(pool2: WorkerPool, entry: str) -> None:
    for result in pool2.run(state_and_unfreeze, entry):
        assert result["equal"]
        assert "became trainable after sharding" in result["refusal"] and "bfloat16" in result["refusal"]


def meta_then_to_empty(rank: int, world: int) -> dict[str, Any]:
    """A mixed unit sharded on ``meta`` (as Accelerate's RAM-efficient loading does), then ``to_empty`` and a full
    state dict loaded: its output equals the unsharded model's; casting after sharding is refused by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from fullshard import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    reference = Adapted()
    with torch.device("meta"):
        model = Adapted()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    set_model_state_dict(model, reference.state_dict(), options=options)
    x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cast = {k: v.to(torch.bfloat16) for k, v in reference.named_parameters()}
        expected = torch.func.functional_call(reference, cast, (x.to(torch.bfloat16),))
        got = model(x)
    dtypes = {p.dtype for p in model.parameters()}
    try:
        model.to(torch.float32)
        refusal = "not refused"
    except ValueError as err:
        refusal = str(err)
    return {"equal": torch.equal(got, expected), "dtypes": dtypes, "refusal": refusal}


def test_mixed_unit_from_meta(pool2: WorkerPool) -> None:
    for result in pool2.run(meta_then_to_empty):
        assert result["equal"]  # the same bf16 casts of the same values, the same ops
        assert result["dtypes"] == {torch.bfloat16, torch.float32}
        assert "cannot be cast after sharding" in result["refusal"], result["refusal"]


def optimizer_state_round_trip(rank: int, world: int) -> dict[str, Any]:
    """The FSDP class's full optimizer state dict of a mixed unit holds the fp32 trainable parameters only, whole,
    and loads back into a fresh model's optimizer to the same shards."""
    from fullshard import FSDP, MixedPrecision

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = FSDP(Adapted(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), use_orig_params=True)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    model, optimizer = build()
    model(torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))).sum().backward()
    optimizer.step()
    full = FSDP.optim_state_dict(model, optimizer)
    fresh, fresh_optimizer = build()
    fresh_optimizer.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_optimizer, full))

    def moments(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [s["exp_avg"] for s in opt.state.values()]

    return {
        "keys": sorted(full["state"]),
        "shapes": sorted(tuple(s["exp_avg"].shape) for s in full["state"].values()),
        "equal": all(torch.equal(a, b) for a, b in zip(moments(optimizer), moments(fresh_optimizer))),
        "count": len(fresh_optimizer.state),
    }


def test_mixed_unit_optimizer_state_round_trip(pool2: WorkerPool) -> None:
    for result in pool2.run(optimizer_state_round_trip):
        assert result["keys"] == ["a.weight", "b.weight"]  # no state for the frozen base
        assert result["shapes"] == sorted([(RANK, DIM), (DIM, RANK)])  # whole tensors
        assert result["equal"] and result["count"] == 2

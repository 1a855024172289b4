"""Trainable tensor-subclass parameters with torch FSDP2's all-gather extension protocol (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``) under ``fully_shard``, against torch's own ``fully_shard`` on the same ranks, model and data
(as torch's ``test_fully_shard_extensions.py`` trains ``TwoTensor`` weights). Frozen ones (QLoRA bases) are
``tests/distributed/test_qlora.py``'s."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.two_tensor import TwoTensor

from fullshard import FullyShardedDataParallel, fully_shard
from fullshard.testing import WorkerPool

ATOL, RTOL = 1e-6, 1e-5


def _pre_all_gather(self, mesh):
    return (self.a, self.b), None


def _pre_all_gather_padded(self, mesh, outer_size, outer_stride, module, mp_policy):
    """Each plane padded to a full shard's rows (torch's fully_shard needs the extension to pad uneven shards)."""
    rows = -(-outer_size[0] // mesh.size())
    padded = []
    for t in (self.a, self.b):
        out = t.new_zeros((rows, *t.shape[1:]))
        out[: t.shape[0]].copy_(t)
        padded.append(out)
    return tuple(padded), None


def _post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
    a, b = outputs
    if out is not None:  # gathered again into the same buffers: out already views them, unless cast
        if a.dtype != param_dtype:  # without bumping versions autograd saved in forward (torch's contract)
            with torch.no_grad(), _unsafe_preserve_version_counter(out.a), _unsafe_preserve_version_counter(out.b):
                out.a.copy_(a)
                out.b.copy_(b)
        return None
    if a.dtype != param_dtype:  # cast to the compute dtype (param_dtype): the cast planes are freed at reshard
        full = TwoTensor(a.to(param_dtype), b.to(param_dtype))
        return full, (full.a, full.b)
    return TwoTensor(a, b), (a, b)


def _pre_all_gather_bf16(self, mesh):
    return (self.a.to(torch.bfloat16),), None


def _post_all_gather_bf16(self, outputs, metadata, param_dtype, *, out=None):
    """Gathered in bf16, given to compute as a plain tensor upcast to the parameter's dtype (freed at reshard)."""
    (tensor,) = outputs
    if out is not None:  # autograd saved out in forward: the regather must not bump its version (torch's contract)
        with torch.no_grad(), _unsafe_preserve_version_counter(out):
            out.copy_(tensor)
        return None
    upcast = tensor.to(param_dtype)
    return upcast, (tensor, upcast)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


class Net(nn.Sequential):
    """Two MLPs in a row; with ``skip`` the second is called but its output dropped ("unused"), or not called
    ("uncalled")."""

    skip: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self[0](x)
        if self.skip == "unused":
            self[1](x)
        return y if self.skip else self[1](y)


def _model(bias: bool, hidden: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    model = Net(MLP(4, hidden, bias), MLP(4, hidden, bias))
    for mlp in model:
        for lin in (mlp.in_proj, mlp.out_proj):
            # b differs from a, so the test sees which of the two the gradient and the step follow
            lin.weight = nn.Parameter(TwoTensor(lin.weight.detach().clone(), 2 * lin.weight.detach()))
    return model


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _planes(t: torch.Tensor) -> list[torch.Tensor]:
    return [t.a, t.b] if isinstance(t, TwoTensor) else [t]


def _train(
    model: nn.Module,
    shard_fn,
    reshard: bool,
    steps: int = 3,
    accumulate: bool = False,
    freeze: bool = False,
    skip: str | None = None,
    mp_policy=None,
    divide_factor: float | None = None,
) -> tuple[list[float], dict[str, list]]:
    for unit in [*model, model]:
        shard_fn(unit, reshard_after_forward=reshard, **({"mp_policy": mp_policy} if mp_policy else {}))
        if divide_factor is not None:  # torch on gloo needs sum reductions for a divide factor (no PREMUL_SUM)
            unit.set_gradient_divide_factor(divide_factor)
            unit.set_force_sum_reduction_for_comms(True)
    if freeze:  # frozen after sharding (as torch's test_fully_shard_frozen does)
        model[0].in_proj.weight.requires_grad_(False)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    calls = []  # run once per reduction with the sharded .grad in place (none in a step that did not use it)
    model[1].in_proj.weight.register_post_accumulate_grad_hook(lambda p: calls.append(_local(p.grad).sum()))
    losses, grads = [], {}
    for step in range(steps):
        torch.manual_seed(100 + 10 * step + dist.get_rank())
        model.skip = skip if step == 1 else None  # after a zero_grad(set_to_none=True)
        if accumulate:  # a micro-batch without gradient sync first: its gradient waits for the synced one
            model.set_requires_gradient_sync(False)
            (model(torch.randn(3, 4)).sum() * 0.5).backward()
            model.set_requires_gradient_sync(True)
        loss = model(torch.randn(3, 4)).sum()
        loss.backward()
        for name, p in model.named_parameters():  # the sharded gradients (reduced, averaged), before the step
            grads[f"grad{step}." + name] = [x.clone() for x in _planes(_local(p.grad))] if p.grad is not None else None
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        losses.append(float(loss.detach().a if isinstance(loss, TwoTensor) else loss.detach()))
    state = {}
    for name, value in model.state_dict().items():  # the sharded parameters, as DTensors over TwoTensor rows
        assert isinstance(value, DTensor), name
        state["state_dict." + name] = [x.detach().clone() for x in _planes(_local(value))]
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        state[name] = [x.detach().clone() for x in _planes(_local(p))]
    return losses, {**state, **grads, "post_accumulate_grad_hook": [torch.stack(calls)]}


def _full_params(model: nn.Module) -> dict[str, tuple[bool, list[torch.Tensor]]]:
    """Each parameter as registered (full, inside summon_full_params or after unshard()): requires_grad, planes."""
    full = {}
    for name, p in model.named_parameters():
        assert not isinstance(p, DTensor), name
        full[name] = (p.requires_grad, [x.detach().clone() for x in _planes(p)])
    return full


def _extension_params(model: nn.Module) -> list:
    return [ep for mlp in model for ep in fully_shard.state(mlp).group.extension.params]


def _parity(
    rank: int,
    world: int,
    bias: bool,
    reshard: bool,
    hidden: int = 8,
    accumulate: bool = False,
    bf16: bool = False,
    freeze: bool = False,
    skip: str | None = None,
    mp: dict | None = None,
    divide_factor: float | None = None,
) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

    from fullshard import MixedPrecisionPolicy

    TwoTensor.fsdp_pre_all_gather = _pre_all_gather if hidden % world == 0 else _pre_all_gather_padded
    TwoTensor.fsdp_post_all_gather = _post_all_gather
    if bf16:
        TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather = _pre_all_gather_bf16, _post_all_gather_bf16
    try:
        model = _model(bias, hidden)
        mine = copy.deepcopy(model)
        kw = dict(accumulate=accumulate, freeze=freeze, skip=skip, divide_factor=divide_factor)
        ours = _train(mine, fully_shard, reshard, mp_policy=MixedPrecisionPolicy(**mp) if mp else None, **kw)
        # at rest, nothing gathered holds memory (the upcast full tensors of the bf16 hooks included)
        for mlp in mine:
            for lin in (mlp.in_proj, mlp.out_proj):
                assert isinstance(lin.weight, DTensor)
        held = [sum(x.untyped_storage().nbytes() for x in _planes(ep.full)) for ep in _extension_params(mine)]
        assert held == [0] * 4, held
        theirs = _train(
            model, torch_fully_shard, reshard, mp_policy=TorchMixedPrecisionPolicy(**mp) if mp else None, **kw
        )
        with FullyShardedDataParallel.summon_full_params(mine):  # the full parameters, as torch's unshard() shows
            summoned = _full_params(mine)
        for unit in [*model, model]:
            unit.unshard()
        unsharded = _full_params(model)
        for unit in [*model, model]:
            unit.reshard()
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(theirs[0]), atol=ATOL, rtol=RTOL)
    assert summoned.keys() == unsharded.keys()
    for name, (requires_grad, planes) in summoned.items():  # trainable where torch's are (frozen where frozen)
        assert requires_grad is unsharded[name][0], (name, requires_grad)
        for mine, ref in zip(planes, unsharded[name][1], strict=True):  # torch's in param_dtype, ours not
            assert type(mine) is type(ref), name
            torch.testing.assert_close(mine.to(ref.dtype), ref, atol=ATOL, rtol=RTOL, msg=name)
    assert ours[1].keys() == theirs[1].keys()
    for name in ours[1]:
        if ours[1][name] is None or theirs[1][name] is None:  # no gradient (a frozen or unused weight)
            assert ours[1][name] is theirs[1][name] is None, name
            continue
        for mine, ref in zip(ours[1][name], theirs[1][name], strict=True):
            assert type(mine) is type(ref), name
            torch.testing.assert_close(mine, ref, atol=ATOL, rtol=RTOL, msg=name)
    # the sharded weights are DTensors over this rank's TwoTensor rows, and they moved
    weight = _model(bias, hidden)[0].in_proj.weight
    rows = torch.chunk(weight.a, world, 0)[rank]
    assert torch.equal(ours[1]["0.in_proj.weight"][0], rows) == freeze


@pytest.mark.parametrize("bias", [False, True], ids=["subclass-only", "with-plain"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_trainable_two_tensor_matches_torch(pool2: WorkerPool, bias: bool, reshard: bool) -> None:
    pool2.run(_parity, bias, reshard)


def test_trainable_two_tensor_uneven_rows_match_torch(pool2: WorkerPool) -> None:
    """5 rows over 2 ranks: rank 0 holds 3, rank 1 holds 2; gathered from padded shards, cut back to 5 rows."""
    pool2.run(_parity, True, True, 5)


def test_trainable_two_tensor_gradient_accumulation_matches_torch(pool2: WorkerPool) -> None:
    """With gradient sync off for a micro-batch, its unsharded gradient is added to the next synced one's."""
    pool2.run(_parity, True, True, 8, True)


def test_trainable_subclass_gathered_in_bf16_matches_torch(pool2: WorkerPool) -> None:
    """Hooks that gather bf16 and give a plain fp32 tensor to compute (torch's test's pattern): same numbers as
    torch, and the upcast full tensors are freed at reshard."""
    pool2.run(_parity, False, True, 8, False, True)


def test_trainable_subclass_frozen_after_sharding_matches_torch(pool2: WorkerPool) -> None:
    """A TwoTensor weight frozen after fully_shard gets no gradient and keeps its value, as under torch."""
    pool2.run(_parity, True, True, 8, False, False, True)


@pytest.mark.parametrize("skip", ["unused", "uncalled"])
def test_trainable_subclass_unused_in_a_step_gets_no_gradient_as_torch(pool2: WorkerPool, skip: str) -> None:
    """A step whose loss does not use the second MLP (called with its output dropped, or not called), after a
    zero_grad(set_to_none=True): its TwoTensor weights keep no gradient, as under torch (a zero one would let Adam
    move them on its momentum), and the next step matches too."""
    pool2.run(functools.partial(_parity, skip=skip), True, True)


def test_trainable_subclass_reduced_in_reduce_dtype_as_torch(pool2: WorkerPool) -> None:
    """MixedPrecisionPolicy(reduce_dtype=bf16) over float32 TwoTensor weights: reduced in bf16 (rounded as torch
    rounds them), landing in float32."""
    pool2.run(functools.partial(_parity, mp=dict(reduce_dtype=torch.bfloat16)), True, True)


def test_trainable_subclass_unsynced_micro_batches_sum_in_reduce_dtype_as_torch(pool2: WorkerPool) -> None:
    """bf16 compute, float32 reduce_dtype, a micro-batch with gradient sync off before each synced one: the TwoTensor
    weights' unsharded gradients add up in float32, not in bf16 (torch FSDP2's rule, as for plain parameters)."""
    mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pool2.run(functools.partial(_parity, mp=mp, accumulate=True), True, True)


def test_trainable_subclass_gradient_divide_factor_as_torch(pool2: WorkerPool) -> None:
    """set_gradient_divide_factor(0.5) on every unit: the TwoTensor weights' gradients are the sum over the ranks
    divided by 0.5, as the plain ones beside them and as under torch."""
    pool2.run(functools.partial(_parity, divide_factor=0.5), True, True)


def _replicas_of_one_rank_refused(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = _model(True)
    TwoTensor.fsdp_pre_all_gather = _pre_all_gather
    TwoTensor.fsdp_post_all_gather = _post_all_gather
    try:
        with pytest.raises(ValueError, match="one rank per shard group") as err:
            fully_shard(model[0], mesh=mesh)
        model[0].in_proj.weight.requires_grad_(False)  # frozen ones get no gradient: taken
        model[0].out_proj.weight.requires_grad_(False)
        fully_shard(model[0], mesh=mesh)
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather
    return str(err.value)


def test_trainable_subclass_replicated_over_shard_groups_of_one_rank_is_refused(pool2: WorkerPool) -> None:
    """HSDP with one rank per shard group: a trainable subclass parameter would get no all-reduce across the
    replicas (found by hand: each replica kept its own gradient), so it is refused on every rank, naming the fix."""
    for message in pool2.run(_replicas_of_one_rank_refused):
        assert "'in_proj.weight'" in message and "Shard it over two or more ranks" in message


def _fsdp1_refuses(rank: int, world: int) -> str:
    TwoTensor.fsdp_pre_all_gather = _pre_all_gather
    TwoTensor.fsdp_post_all_gather = _post_all_gather
    try:
        with pytest.raises(ValueError, match="does not train tensor-subclass parameters") as err:
            FullyShardedDataParallel(_model(False))
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather
    return str(err.value)


def test_fsdp_class_refuses_trainable_subclass_parameters(pool2: WorkerPool) -> None:
    for message in pool2.run(_fsdp1_refuses):  # on every rank, naming the parameters and the fix
        assert "'0.in_proj.weight'" in message and "Use fully_shard" in message

"""What sharding leaves on each rank, the FSDP methods around it, wrap policies and ignored modules."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fullshard import FSDP, FSDPModule
from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.testing.parity import fully_shard_blocks
from fullshard.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    enable_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _layout(rank: int, world: int, entry: str) -> dict[str, object]:
    full = {n: p.numel() for n, p in _model().named_parameters()}
    model = _model()
    if entry == "fsdp":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    else:
        fully_shard_blocks(model)
    local = {n: _local(p).numel() for n, p in model.named_parameters()}
    placements = {str(getattr(p, "placements", None)) for _, p in model.named_parameters()}
    is_module = isinstance(model, FSDPModule), isinstance(model, TinyGPT)
    return {"full": full, "local": local, "placements": placements, "is_module": is_module}


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_each_rank_holds_its_shard(pool2: WorkerPool, entry: str) -> None:
    results = pool2.run(_layout, entry)
    full = results[0]["full"]
    assert results[0]["local"].keys() == full.keys()  # original names
    for name, numel in full.items():
        got = [r["local"][name] for r in results]
        assert sum(got) == numel, name
        assert max(got) == -(-full_rows(name) // 2) * (numel // full_rows(name)), name
    total = sum(full.values())
    for r in results:
        assert sum(r["local"].values()) <= total / 2 * 1.1
    if entry == "fully_shard":
        assert results[0]["placements"] == {"(Shard(dim=0),)"}
        assert results[0]["is_module"] == (True, True)


def full_rows(name: str) -> int:
    shapes = {n: p.shape for n, p in _model().named_parameters()}
    return shapes[name][0]


def _units(rank: int, world: int, how: str) -> list[str]:
    model = _model()
    if how == "size":
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=1500)
        model = FSDP(model, auto_wrap_policy=policy)
    elif how == "transformer":
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block, nn.Embedding})
        model = FSDP(model, auto_wrap_policy=policy)
    elif how == "custom":
        policy = CustomPolicy(lambda m: {"sharding_strategy": "SHARD_GRAD_OP"} if isinstance(m, Block) else False)
        model = FSDP(model, auto_wrap_policy=policy)
    elif how == "callable":
        model = FSDP(model, auto_wrap_policy=lambda m, recurse, n: recurse or isinstance(m, nn.LayerNorm))
    elif how == "manual":
        with enable_wrap(wrapper_cls=FSDP, sharding_strategy="FULL_SHARD"):
            model.blocks[0] = wrap(model.blocks[0])
            model = wrap(model)
    elif how == "nested":
        model.blocks[1] = FSDP(model.blocks[1])
        model = FSDP(model)
    x, y = make_batch(model.cfg, 2, 0)
    model(x, y).backward()
    modules = FSDP.fsdp_modules(model)
    assert FSDP.fsdp_modules(model, root_only=True) == [model]
    return sorted(f"{type(m.module).__name__}:{m.sharding_strategy.name}" for m in modules)


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("size", ["Block:FULL_SHARD", "Block:FULL_SHARD", "TinyGPT:FULL_SHARD"]),
        ("transformer", ["Block:FULL_SHARD"] * 2 + ["Embedding:FULL_SHARD"] * 2 + ["TinyGPT:FULL_SHARD"]),
        ("custom", ["Block:SHARD_GRAD_OP", "Block:SHARD_GRAD_OP", "TinyGPT:FULL_SHARD"]),
        ("callable", ["LayerNorm:FULL_SHARD"] * 5 + ["TinyGPT:FULL_SHARD"]),
        ("manual", ["Block:FULL_SHARD", "TinyGPT:FULL_SHARD"]),
        ("nested", ["Block:FULL_SHARD", "TinyGPT:FULL_SHARD"]),
    ],
)
def test_wrap_policies(pool2: WorkerPool, how: str, expected: list[str]) -> None:
    results = pool2.run(_units, how)
    assert results[0] == results[1] == sorted(expected)


def _summon_writeback(rank: int, world: int, entry: str) -> list[float]:
    model = _model()
    if entry == "fsdp":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    else:
        fully_shard_blocks(model)
    with FSDP.summon_full_params(model, writeback=True):
        for _, p in model.named_parameters():
            assert p.shape != torch.Size([0])
        with torch.no_grad():
            model.blocks[0].fc.weight.fill_(0.5)
            model.logit_scale.fill_(2.0)
    x, y = make_batch(model.cfg, 2, 3)
    loss = model(x, y)
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
        seen = model.blocks[0].fc.weight.detach().clone()
        if rank == 0:
            assert torch.all(seen == 0.5)
    return [loss.item(), float(_local(model.logit_scale).sum())]


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_summon_full_params_writeback(pool2: WorkerPool, entry: str) -> None:
    reference = _model()
    with torch.no_grad():
        reference.blocks[0].fc.weight.fill_(0.5)
        reference.logit_scale.fill_(2.0)
    x, y = make_batch(reference.cfg, 2, 3)
    want = reference(x, y).item()
    results = pool2.run(_summon_writeback, entry)
    for loss, _ in results:
        assert abs(loss - want) < 1e-5
    # The one-element parameter lives on rank 0 only; its shard got the written value.
    assert [scale for _, scale in results] == [2.0, 0.0]


def _with_grads(rank: int, world: int) -> list[float]:
    model = FSDP(_model(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    x, y = make_batch(model.cfg, 4, 5)
    per = 2
    model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
    with FSDP.summon_full_params(model, with_grads=True, offload_to_cpu=True):
        return model.blocks[1].fc.weight.grad.flatten()[:5].tolist()


def test_summon_with_grads(pool2: WorkerPool) -> None:
    reference = _model()
    x, y = make_batch(reference.cfg, 4, 5)
    reference(x, y).backward()
    want = reference.blocks[1].fc.weight.grad.flatten()[:5]
    for got in pool2.run(_with_grads):
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-6, rtol=1e-5)


def _ignored(rank: int, world: int) -> dict[str, object]:
    model = _model()
    ignored = model.blocks[1]
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), ignored_modules=[ignored])
    x, y = make_batch(model.cfg, 4, 7)
    per = 2
    model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
    return {
        "ignored_shape": tuple(ignored.fc.weight.shape),
        "ignored_grad": ignored.fc.weight.grad.clone(),
        "units": len(FSDP.fsdp_modules(model)),
    }


def test_ignored_modules_are_not_sharded_nor_reduced(pool2: WorkerPool) -> None:
    results = pool2.run(_ignored)
    model = _model()
    x, y = make_batch(model.cfg, 4, 7)
    for rank, result in enumerate(results):
        assert result["ignored_shape"] == tuple(model.blocks[1].fc.weight.shape)
        assert result["units"] == 2
        local = _model()
        local.zero_grad()
        local(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]).backward()
        # The local gradient, not the average over ranks.
        torch.testing.assert_close(result["ignored_grad"], local.blocks[1].fc.weight.grad, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(results[0]["ignored_grad"], results[1]["ignored_grad"])


def _apply_and_buffers(rank: int, world: int) -> dict[str, object]:
    model = _model()
    model.register_buffer("steps_seen", torch.zeros(3))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.LayerNorm):
            m.weight.data.fill_(3.0)

    model.apply(init)
    with FSDP.summon_full_params(model):
        weights = [float(m.weight.mean()) for m in model.modules() if isinstance(m, nn.LayerNorm)]
    return {
        "buffers": [n for n, _ in model.named_buffers()],
        "ln_means": weights,
        "module": type(model.module).__name__,
    }


def test_apply_named_buffers_and_module(pool2: WorkerPool) -> None:
    result = pool2.run(_apply_and_buffers)[0]
    assert result["buffers"] == ["steps_seen"]
    assert result["ln_means"] == [3.0] * 5
    assert result["module"] == "TinyGPT"


def _forward_twice_no_backward(rank: int, world: int) -> float:
    model = FSDP(_model(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    x, y = make_batch(model.cfg, 2, 1)
    with torch.no_grad():
        first = model(x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x, y).backward()
    opt.step()
    with torch.no_grad():
        after = model(x, y)
    loss = torch.stack([first - after])
    dist.all_reduce(loss)
    return loss.item()


def test_step_is_seen_by_next_forward(pool2: WorkerPool) -> None:
    # A forward after optimizer.step() must use the new parameters, never a stale gathered copy.
    for delta in pool2.run(_forward_twice_no_backward):
        assert delta > 0

"""Element-wise optimizers step on the local tensors of ``fully_shard``'s parameters (``engine/local_step.py``).

Checked on 2 ranks, against the same optimizer stepping the ``DTensor`` parameters (what torch FSDP2 does;
``FULLSHARD_LOCAL_OPTIMIZER_STEP=0``): parameters and every state value ``torch.equal`` after three steps (the
same kernels on the same inputs, so on any CPU), state values ``DTensor``\\ s laid out as their parameter, the
same ``state_dict()``; the step itself sees plain tensors, and everything is back after it; a step that raises
is undone by ``state_dict()`` and by the next forward (with ``zero_grad()`` in between); what is never swapped
(a closure, a subclass) steps on ``DTensor``\\ s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.engine.local_step import ENV_VAR
from fullshard.testing import WorkerPool
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch
from fullshard.testing.parity import fully_shard_blocks
from tests.distributed.test_switch_optimizer import param_groups

CFG = GPTConfig()

OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = {
    "adamw": lambda g: torch.optim.AdamW(g, lr=1e-2),
    "adamw amsgrad foreach": lambda g: torch.optim.AdamW(g, lr=1e-2, amsgrad=True, foreach=True),
    "adam maximize": lambda g: torch.optim.Adam(g, lr=1e-2, maximize=True),
    "sgd momentum nesterov": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True),
    "sgd plain foreach": lambda g: torch.optim.SGD(g, lr=0.1, foreach=True),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=0.1),
    "adamax": lambda g: torch.optim.Adamax(g, lr=1e-2),
    "adadelta": lambda g: torch.optim.Adadelta(g),
    "nadam": lambda g: torch.optim.NAdam(g, lr=1e-2),
    "radam": lambda g: torch.optim.RAdam(g, lr=1e-2),
    "rmsprop centered": lambda g: torch.optim.RMSprop(g, lr=1e-3, centered=True, momentum=0.5),
    "asgd": lambda g: torch.optim.ASGD(g, lr=1e-2),
}


def sharded_model() -> nn.Module:
    torch.manual_seed(0)
    return fully_shard_blocks(TinyGPT(CFG))


def backward(model: nn.Module, rank: int, step: int) -> None:
    x, y = make_batch(CFG, 4, step)
    model(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]).backward()


def all_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def as_compared(value: Any) -> tuple[Any, ...]:
    if isinstance(value, DTensor):
        return (DTensor, value.placements, value.to_local().detach().clone())
    return (type(value), value)


def seen_by_step(optimizer: torch.optim.Optimizer) -> list[type]:
    """Records, at each step, the types the optimizer's own pre-hooks see in its param groups."""
    seen: list[type] = []
    optimizer.register_step_pre_hook(lambda opt, a, k: seen.extend(type(p) for p in all_params(opt)))
    return seen


def train(rank: int, name: str, local: bool, steps: int = 3) -> dict[str, Any]:
    os.environ[ENV_VAR] = "1" if local else "0"
    model = sharded_model()
    params = list(model.parameters())
    optimizer = OPTIMIZERS[name](param_groups(model))
    seen = seen_by_step(optimizer)
    for step in range(steps):
        backward(model, rank, step)
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            kept = [optimizer.state[p] for p in params]  # a reference to a state dict stays the parameter's
    os.environ.pop(ENV_VAR)
    back = all_params(optimizer)
    state = {i: {k: as_compared(v) for k, v in optimizer.state[p].items()} for i, p in enumerate(params)}
    return {
        "params": [p.to_local().detach().clone() for p in params],
        "state": state,
        "seen": {t.__name__ for t in seen},
        "back": len(back) == len(params) and {id(p) for p in back} == {id(p) for p in params},
        "state_keys": set(optimizer.state) == set(params),
        "same_dicts": all(optimizer.state[p] is d for p, d in zip(params, kept, strict=True)),
        "osd_types": sorted({type(v).__name__ for s in optimizer.state_dict()["state"].values() for v in s.values()}),
    }


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for a, b in zip(got["params"], want["params"], strict=True):
        assert torch.equal(a, b)
    assert got["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        assert got["state"][i].keys() == state.keys(), i
        for key, value in state.items():
            ours = got["state"][i][key]
            assert ours[0] is value[0], (i, key, ours[0], value[0])
            if value[0] is DTensor:
                assert ours[1] == value[1] and torch.equal(ours[2], value[2]), (i, key)
            elif isinstance(value[1], torch.Tensor):
                assert torch.equal(ours[1], value[1]), (i, key)
            else:
                assert ours[1] == value[1], (i, key)


def local_against_dtensor(rank: int, world: int, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return train(rank, name, local=True), train(rank, name, local=False)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_local_step_is_the_dtensor_step(pool2: WorkerPool, name: str) -> None:
    for ours, theirs in pool2.run(local_against_dtensor, name):
        assert ours["seen"] == {"Tensor"}, ours["seen"]  # the step computed on local tensors
        assert theirs["seen"] == {"DTensor"}, theirs["seen"]
        assert ours["back"] and ours["state_keys"]  # the DTensor parameters are back, and key the state
        assert ours["same_dicts"] and theirs["same_dicts"]
        assert ours["osd_types"] == theirs["osd_types"]
        assert_same(ours, theirs)


def rprop_against_plain_shards(rank: int, world: int) -> list[bool]:
    """Rprop fails on ``DTensor``\\ s (``index_put_`` on a ``Shard(0)`` tensor, torch FSDP2 alike); here it is the same
    optimizer on plain copies of this rank's rows, with the same gradients."""
    model = sharded_model()
    params = list(model.parameters())
    optimizer = torch.optim.Rprop(params, lr=1e-2)
    plain = [p.to_local().detach().clone() for p in params]
    mirror = torch.optim.Rprop(plain, lr=1e-2)
    for step in range(3):
        backward(model, rank, step)
        for copy, p in zip(plain, params, strict=True):
            copy.grad = p.grad.to_local().clone()
        optimizer.step()
        mirror.step()
        optimizer.zero_grad()
    return [torch.equal(p.to_local(), copy) for p, copy in zip(params, plain, strict=True)]


def test_rprop_steps_the_shards(pool2: WorkerPool) -> None:
    for same in pool2.run(rprop_against_plain_shards):
        assert all(same), same


class MyAdamW(torch.optim.AdamW):
    """A subclass may compute anything in its step: never swapped."""


def not_swapped(rank: int, world: int) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    model = sharded_model()
    subclass = MyAdamW(model.parameters(), lr=1e-2)
    seen = seen_by_step(subclass)
    backward(model, rank, 0)
    subclass.step()
    out["subclass"] = {t.__name__ for t in seen}
    closure_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = seen_by_step(closure_opt)

    def closure() -> torch.Tensor:
        closure_opt.zero_grad()
        x, y = make_batch(CFG, 2, 1)
        loss = model(x, y)
        loss.backward()
        return loss

    closure_opt.step(closure)
    out["closure"] = {t.__name__ for t in seen}
    return out


def test_what_is_never_swapped(pool2: WorkerPool) -> None:
    for got in pool2.run(not_swapped):
        assert got == {"subclass": {"DTensor"}, "closure": {"DTensor"}}


class Raise:
    """An optimizer pre-hook that raises once, after the global hook swapped the parameters."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError("hook failed")


def raised_step(rank: int, world: int) -> dict[str, Any]:
    want = train(rank, "adamw", local=True, steps=3)["params"]
    model = sharded_model()
    params = list(model.parameters())
    optimizer = OPTIMIZERS["adamw"](param_groups(model))
    backward(model, rank, 0)
    optimizer.step()
    optimizer.zero_grad()
    # Step 1 raises after the swap; state_dict() puts the DTensors back.
    optimizer.register_step_pre_hook(Raise())
    backward(model, rank, 1)
    with contextlib.suppress(RuntimeError):
        optimizer.step()
    osd_types = sorted({type(v).__name__ for s in optimizer.state_dict()["state"].values() for v in s.values()})
    restored = [id(p) for p in all_params(optimizer)] == [id(p) for g in param_groups(model) for p in g["params"]]
    step1_grads_kept = all(p.grad is not None for p in params)
    # Raise again, then the loop goes on as a user's would: zero_grad(), then a forward that restores.
    optimizer.register_step_pre_hook(Raise())
    with contextlib.suppress(RuntimeError):
        optimizer.step()
    optimizer.zero_grad()  # on the swapped local tensors
    backward(model, rank, 1)
    optimizer.step()
    optimizer.zero_grad()
    backward(model, rank, 2)
    optimizer.step()
    got = [p.to_local() for p in params]
    return {
        "osd_types": osd_types,
        "restored": restored,
        "kept": step1_grads_kept,
        "same": all(torch.equal(a, b) for a, b in zip(got, want, strict=True)),
    }


def test_a_raised_step_is_undone(pool2: WorkerPool) -> None:
    for got in pool2.run(raised_step):
        assert got["osd_types"] == ["DTensor", "Tensor"], got["osd_types"]  # exp_avg(_sq) DTensors, step a Tensor
        assert got["restored"] and got["kept"]
        assert got["same"]

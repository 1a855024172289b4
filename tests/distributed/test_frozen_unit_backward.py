"""A unit without trainable parameters is freed as soon as its backward is done, not at the end of backward.

Set up: a trainable ``body`` Linear (a unit), then a frozen ``tail`` unit of two Linears (``[norm, lm_head]``'s
place in a LoRA model, kept gathered after forward as Accelerate asks for its tail), called once or twice per
forward, under ``fully_shard`` and the FSDP class (2 gloo ranks, fp32, the same batch on both ranks).
Run: one forward and backward; a hook on the body's output gradient (which autograd computes after the tail's
backward) records whether the tail's parameters are still gathered then.
Check: the tail is sharded again by then (it stayed gathered until the end of backward before); the body's gradient
equals one process's (the tail was not freed while its backward still needed it, also when called twice).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fullshard.testing import WorkerPool

DIM = 6


class Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 3)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(x)))


class Model(nn.Module):
    def __init__(self, calls: int) -> None:
        super().__init__()
        self.body = nn.Linear(DIM, DIM)
        self.tail = Tail()
        self.calls = calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return sum(self.tail(h * (i + 1)) for i in range(self.calls))  # type: ignore[return-value]


def _model(calls: int) -> Model:
    torch.manual_seed(0)
    return Model(calls)


def _batch() -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))


def tail_freed_in_backward(rank: int, world: int, entry: str, calls: int) -> dict[str, Any]:
    from fullshard import FSDP, fully_shard
    from fullshard.engine.names import STATE_ATTR
    from fullshard.wrap import ModuleWrapPolicy

    model: nn.Module = _model(calls)
    body = model.body
    if entry == "fully_shard":
        fully_shard(model.body)
        fully_shard(model.tail, reshard_after_forward=False)
        fully_shard(model)
        tail_unit = getattr(model.tail, STATE_ATTR)
    else:
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Tail}), use_orig_params=True)
        tail_unit = next(m for m in model.modules() if isinstance(m, FSDP) and isinstance(m.module, Tail))._unit
    seen: list[str] = []  # the tail's state when the body's output gradient is ready (after the tail's backward)

    def watch(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: seen.append(tail_unit.group.state.name))

    body.register_forward_hook(watch)
    model(_batch()).sum().backward()
    after = tail_unit.group.state.name
    if entry == "fully_shard":
        grads = [body.weight.grad.full_tensor(), body.bias.grad.full_tensor()]
    else:
        with FSDP.summon_full_params(model, with_grads=True):
            grads = [body.weight.grad.clone(), body.bias.grad.clone()]
    reference = _model(calls)
    reference(_batch()).sum().backward()
    expected = [reference.body.weight.grad, reference.body.bias.grad]
    return {"seen": seen, "after": after, "error": max((g - e).abs().max().item() for g, e in zip(grads, expected))}


@pytest.mark.parametrize("calls", [1, 2])
@pytest.mark.parametrize("entry", ["fully_shard", "fsdp1"])
def test_frozen_unit_freed_when_its_backward_is_done(pool2: WorkerPool, entry: str, calls: int) -> None:
    # Before, the tail stayed gathered until the root's final callback: seen == ["UNSHARDED"].
    for result in pool2.run(tail_freed_in_backward, entry, calls):
        assert result["seen"] == ["SHARDED"], result
        assert result["after"] == "SHARDED"
        assert result["error"] < 1e-6, result  # both ranks ran the same batch: the mean is that batch's gradient

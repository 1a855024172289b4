"""init_optimizer_state: creates zero state of the right shapes and leaves everything else as it was."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from fullshard.algorithms.optim_init import init_optimizer_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.Linear(5, 2))


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.1), weight_decay=0.5),
    "sgd_l2": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.5),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.1, momentum=0.5, weight_decay=0.5),
}
EXPECTED_KEYS = {
    "adam": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "adamw": {"step", "exp_avg", "exp_avg_sq"},
    "sgd_l2": {"momentum_buffer"},
    "rmsprop": {"step", "square_avg", "momentum_buffer"},
}


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_creates_zero_state_and_changes_nothing_else(kind: str) -> None:
    # - Set up: a fresh optimizer; one parameter holds a gradient (as mid-accumulation)
    model = _model()
    opt = OPTIMIZERS[kind](model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grad = torch.full_like(model[0].weight, 3.0)
    model[0].weight.grad = grad
    lr = opt.param_groups[0]["lr"]
    # - Run
    created = init_optimizer_state(opt)
    # - Check: state for every parameter, zero, of the parameter's shape; parameters, grads, lr untouched
    assert len(created) == len(list(model.parameters())) == len(opt.state)
    for p in model.parameters():
        state = opt.state[p]
        assert set(state) == EXPECTED_KEYS[kind]
        for key, value in state.items():
            assert torch.count_nonzero(value) == 0, key
            if value.dim():
                assert value.shape == p.shape, key
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), f"{name} changed"
    assert model[0].weight.grad is grad and model[2].weight.grad is None
    assert opt.param_groups[0]["lr"] is lr


def test_keeps_existing_state_and_fills_only_the_rest() -> None:
    # - Set up: a stepped optimizer, then a second param group added (as when unfreezing layers)
    model = _model()
    opt = torch.optim.Adam(model[0].parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    kept = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    opt.add_param_group({"params": list(model[2].parameters())})
    # - Run
    created = init_optimizer_state(opt)
    # - Check: only the new group got state; the old state is bitwise what it was
    assert {id(p) for p in created} == {id(p) for p in model[2].parameters()}
    for key, value in kept.items():
        assert torch.equal(opt.state[model[0].weight][key], value)
    assert init_optimizer_state(opt) == [], "a second call has nothing left to create"


def test_a_template_that_loads_like_a_stepped_optimizer() -> None:
    # The point of the helper: a fresh optimizer's state dict now has the entries a checkpoint fills.
    model = _model()
    stepped = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    stepped.step()
    fresh = torch.optim.AdamW(_model().parameters(), lr=0.1)
    init_optimizer_state(fresh)

    def layout(sd: dict[str, Any]) -> dict[Any, Any]:
        return {i: {k: (tuple(v.shape), v.dtype) for k, v in s.items()} for i, s in sd["state"].items()}

    assert layout(fresh.state_dict()) == layout(stepped.state_dict())


def test_stateless_optimizer_gets_none_and_rejects_wrappers() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    assert init_optimizer_state(opt) == []
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    with pytest.raises(TypeError, match=re.escape("init_optimizer_state(optimizer=dict): expected a torch.optim")):
        init_optimizer_state({})  # type: ignore[arg-type]

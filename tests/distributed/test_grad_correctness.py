"""Gradients that must match an unsharded run: parameters frozen after sharding, unused parameters, and the
post-accumulate-grad hooks of sharded parameters.

Each case trains the same model on the same data in one process (the reference, on the whole batch) and on 2
gloo ranks (each its half), with both entry points (``fully_shard`` with ``DTensor`` parameters, and the FSDP
class, whose exposed parameters are the original ones sharded), and compares losses and final parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard import FSDP, fully_shard
from fullshard.testing import WorkerPool
from fullshard.wrap import ModuleWrapPolicy

DIM, ROWS, STEPS = 9, 4, 4  # DIM does not divide 2: uneven shards, padding


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step``: ``ROWS`` rows per rank, 2 ranks."""
    return torch.randn(2 * ROWS, DIM, generator=torch.Generator().manual_seed(1000 + step))


def rows(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per]


def linear_stack() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(DIM, DIM), nn.ReLU()]
    return nn.Sequential(*layers)


class MultiForward(nn.Module):
    """A trainable and a frozen layer, each run several times in one forward, once more under ``no_grad``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.trained = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for _ in range(3):
            x = self.frozen(F.relu(self.trained(x)))
            with torch.no_grad():
                x += F.relu(self.trained(x))
        return x


MODELS: dict[str, Callable[[], nn.Module]] = {"stack": linear_stack, "multi": MultiForward}


# --- freezing ---------------------------------------------------------------------------------------------


def freeze_first(model: nn.Module, step: int) -> None:
    """Before any step: the first Linear frozen (after sharding, as torch's frozen tests do)."""
    if step == 0:
        next(m for m in model.modules() if isinstance(m, nn.Linear)).requires_grad_(False)


def freeze_weights(model: nn.Module, step: int) -> None:
    """Before any step: every weight frozen, biases trained (a unit that mixes both, BitFit)."""
    if step == 0:
        for name, p in model.named_parameters():
            if "bias" not in name:
                p.requires_grad_(False)


def alternate_then_unfreeze(model: nn.Module, step: int) -> None:
    """Every other Linear frozen, all trained again at the last step (fine-tuning that unfreezes)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for i, linear in enumerate(linears):
        linear.requires_grad_(i % 2 == 1 or step == STEPS - 1)


def no_change(model: nn.Module, step: int) -> None:
    pass


CHANGES: dict[str, Callable[[nn.Module, int], None]] = {
    "freeze_first": freeze_first,
    "freeze_weights": freeze_weights,
    "alternate_then_unfreeze": alternate_then_unfreeze,
    "none": no_change,
}


def shard(model: nn.Module, entry: str) -> nn.Module:
    if entry == "FSDP":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(module)
    return fully_shard(model)


def full_params(model: nn.Module, entry: str) -> dict[str, torch.Tensor]:
    if entry == "FSDP":
        with FSDP.summon_full_params(model):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def train(model: nn.Module, change: str, step_fn: Callable[[int], torch.Tensor]) -> list[float]:
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        CHANGES[change](model, step)
        loss = step_fn(step)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        losses.append(loss.item())
    return losses


def reference(model_name: str, change: str) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Single process, whole batch; the loss of each rank's half is recorded too (what each rank sees)."""
    model = MODELS[model_name]()
    halves: list[list[float]] = [[], []]

    def step_fn(step: int) -> torch.Tensor:
        out = model(batch(step)).square()
        for rank in range(2):
            halves[rank].append(rows(out, rank, 2).mean().item())
        return out.mean()

    train(model, change, step_fn)
    return halves, {n: p.detach().clone() for n, p in model.named_parameters()}


def sharded(rank: int, world: int, model_name: str, entry: str, change: str) -> dict[str, object]:
    model = shard(MODELS[model_name](), entry)
    losses = train(model, change, lambda step: model(rows(batch(step), rank, world)).square().mean())
    return {"losses": losses, "params": full_params(model, entry)}


def check_matches_reference(results: list[dict[str, object]], model_name: str, change: str) -> None:
    halves, want = reference(model_name, change)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["losses"], halves[rank], atol=1e-5, rtol=1e-5, msg=f"rank {rank} losses")
        assert sorted(got["params"]) == sorted(want)
        for name, value in want.items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("entry", ["fully_shard", "FSDP"])
@pytest.mark.parametrize("change", ["freeze_first", "freeze_weights", "alternate_then_unfreeze"])
def test_requires_grad_changed_after_sharding_matches_unsharded(pool2: WorkerPool, entry: str, change: str) -> None:
    check_matches_reference(pool2.run(sharded, "stack", entry, change), "stack", change)


@pytest.mark.parametrize("entry", ["fully_shard", "FSDP"])
def test_multi_forward_mixed_requires_grad_matches_unsharded(pool2: WorkerPool, entry: str) -> None:
    check_matches_reference(pool2.run(sharded, "multi", entry, "none"), "multi", "none")

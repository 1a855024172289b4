"""Gradients that must match an unsharded run: parameters frozen after sharding, unused parameters, and the
post-accumulate-grad hooks of sharded parameters.

Each case trains the same model on the same data in one process (the reference, on the whole batch) and on 2
gloo ranks (each its half), with both entry points (``fully_shard`` with ``DTensor`` parameters, and the FSDP
class, whose exposed parameters are the original ones sharded), and compares losses and final parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard import FSDP, fully_shard
from fullshard.engine.group import ParamGroup
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


# --- unused parameters ------------------------------------------------------------------------------------


class DoubleLinear(nn.Module):
    """Two outputs (``lin1``'s and ``lin2``'s), and a parameter forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(DIM, DIM)
        self.lin2 = nn.Linear(DIM, DIM)
        self.lin3 = nn.Linear(DIM, DIM)  # its own unit, never run
        self.unused = nn.Parameter(torch.randn(DIM))  # in the root unit, never used

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.relu(self.lin1(x)), F.relu(self.lin2(x))


def unused_loss(outs: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
    """Both outputs for the first steps, then only the first (``lin2``'s parameters get no gradient)."""
    out1, out2 = outs
    return (out1 * out2).mean() if step < 2 else out1.square().mean()


def unused_reference() -> tuple[list[list[dict[str, object]]], dict[str, torch.Tensor]]:
    model = DoubleLinear()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen: list[dict[str, object]] = []
    for step in range(STEPS):
        unused_loss(model(batch(step)), step).backward()
        seen.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 1)
    return seen, {n: p.detach().clone() for n, p in model.named_parameters()}


def unused_sharded(
    rank: int, world: int, entry: str, reshard_after_forward: bool, one_unit: bool = False
) -> dict[str, object]:
    """``one_unit``: the whole model is one unit, so the unused parameters share it with used ones."""
    model = DoubleLinear()
    if one_unit:
        model = FSDP(model, use_orig_params=True) if entry == "FSDP" else fully_shard(model)
    elif entry == "FSDP":
        policy = ModuleWrapPolicy({nn.Linear})
        strategy = "FULL_SHARD" if reshard_after_forward else "SHARD_GRAD_OP"
        model = FSDP(model, auto_wrap_policy=policy, use_orig_params=True, sharding_strategy=strategy)
    else:
        for lin in (model.lin1, model.lin2, model.lin3):
            fully_shard(lin, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = []
    for step in range(STEPS):
        unused_loss(model(rows(batch(step), rank, world)), step).backward()
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad
            grads[name.replace("_fsdp_wrapped_module.", "")] = None if grad is None else _local(grad).clone()
        seen.append(grads)
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 1)
    return {"grads": seen, "params": full_params(model, entry)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@pytest.mark.parametrize(("reshard_after_forward", "one_unit"), [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("entry", ["fully_shard", "FSDP"])
def test_unused_parameters_get_no_gradient(
    pool2: WorkerPool, entry: str, reshard_after_forward: bool, one_unit: bool
) -> None:
    """A parameter that no output used gets ``.grad`` None (Adam leaves it alone), as unsharded; the others'
    gradients are finite and the final parameters those of the unsharded run."""
    results = pool2.run(unused_sharded, entry, reshard_after_forward, one_unit)
    check_unused(results)


def check_unused(results: list[dict[str, object]]) -> None:
    seen, want = unused_reference()
    for rank, got in enumerate(results):
        for step, (grads, ref) in enumerate(zip(got["grads"], seen)):
            assert sorted(grads) == sorted(ref)
            for name, grad in grads.items():
                where = f"rank {rank} step {step} {name}"
                if ref[name] is None or not ref[name].any():
                    # zeros: the reference kept a zeroed .grad (zero_grad(set_to_none=False)) and used nothing
                    assert (grad is None) == (ref[name] is None), f"{where}: {grad} where unsharded has {ref[name]}"
                if grad is not None:
                    assert torch.isfinite(grad).all() and grad.abs().max() < 1e3, f"{where}: {grad.abs().max()}"
        for name, value in want.items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}")


def one_rank_uses_lin2(rank: int, world: int, entry: str) -> dict[str, object]:
    """Rank 0's loss uses ``lin2``, rank 1's does not: every rank's shard of ``lin2``'s gradient is the average.
    One unit for the whole model (units that run backward on some ranks only would desynchronise the ranks)."""
    model = FSDP(DoubleLinear(), use_orig_params=True) if entry == "FSDP" else fully_shard(DoubleLinear())
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        out1, out2 = model(rows(batch(step), rank, world))
        (out1 * out2 if rank == 0 else out1).mean().backward()
        optim.step()
        optim.zero_grad()
    return full_params(model, entry)


def one_rank_reference() -> dict[str, torch.Tensor]:
    model = DoubleLinear()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        out1, out2 = model(batch(step))
        ((rows(out1 * out2, 0, 2).mean() + rows(out1, 1, 2).mean()) / 2).backward()
        optim.step()
        optim.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("entry", ["fully_shard", "FSDP"])
def test_parameter_used_on_one_rank_only_matches_unsharded(pool2: WorkerPool, entry: str) -> None:
    """A rank that did not use a parameter still takes its shard of the average another rank computed."""
    want = one_rank_reference()
    for rank, got in enumerate(pool2.run(one_rank_uses_lin2, entry)):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}")


# --- post-accumulate-grad hooks on sharded parameters -----------------------------------------------------


def optimizer_in_backward(rank: int, world: int, entry: str, in_backward: bool) -> dict[str, object]:
    """Adam stepped per parameter from its post-accumulate-grad hook (torchtune's optimizer in backward), or as
    usual after backward; the hook also counts its calls and checks that ``.grad`` is the sharded gradient."""
    model = shard(linear_stack(), entry)
    params = list(model.parameters())
    calls = {id(p): 0 for p in params}
    bad: list[str] = []
    if in_backward:
        optims = {id(p): torch.optim.Adam([p], lr=1e-2) for p in params}

        def hook(param: torch.Tensor) -> None:
            calls[id(param)] += 1
            if param.grad is None or _local(param.grad).shape != _local(param).shape:
                bad.append(f"grad {None if param.grad is None else tuple(param.grad.shape)}")
            optims[id(param)].step()
            optims[id(param)].zero_grad()

        for p in params:
            p.register_post_accumulate_grad_hook(hook)
    else:
        optim = torch.optim.Adam(params, lr=1e-2)
    for step in range(STEPS):
        model(rows(batch(step), rank, world)).square().mean().backward()
        if not in_backward:
            optim.step()
            optim.zero_grad()
    return {"params": full_params(model, entry), "calls": sorted(set(calls.values())), "bad": bad}


@pytest.mark.parametrize("entry", ["fully_shard", "FSDP"])
def test_post_accumulate_grad_hooks_step_in_backward(pool2: WorkerPool, entry: str) -> None:
    """Each sharded parameter's hook runs once per backward with its sharded gradient in ``.grad``; stepping
    there trains exactly as stepping after backward."""
    in_backward = pool2.run(optimizer_in_backward, entry, True)
    after = pool2.run(optimizer_in_backward, entry, False)
    for rank, (got, want) in enumerate(zip(in_backward, after)):
        assert got["calls"] == [STEPS], f"rank {rank}: hooks ran {got['calls']} times, not once per backward"
        assert not got["bad"], f"rank {rank}: {got['bad'][:3]}"
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-6, rtol=1e-6, msg=f"rank {rank} {name}")


# --- no unwritten memory reaches a gradient ---------------------------------------------------------------


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Every new floating-point ``torch.empty`` / ``empty_like`` tensor and every newly allocated gathered buffer
    (``flat_full``) starts as NaN, so that a read before a write shows in the numbers instead of depending on what
    the allocator hands out (once seen as a gradient norm of 2.9e17 on a loaded machine)."""
    empty, empty_like, allocate = torch.empty, torch.empty_like, ParamGroup._allocate_full

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and not t.is_meta:
            with torch.no_grad():
                t.fill_(float("nan"))
        return t

    def allocate_poisoned(group: ParamGroup) -> None:
        fresh = group.flat_full.untyped_storage().size() != group.full_nbytes
        allocate(group)
        if fresh:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(group.flat_full):
                group.flat_full.detach().fill_(float("nan"))

    torch.empty = lambda *a, **k: empty(*a, **k) if "out" in k else poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    ParamGroup._allocate_full = allocate_poisoned
    try:
        yield
    finally:
        torch.empty, torch.empty_like, ParamGroup._allocate_full = empty, empty_like, allocate


def poisoned(rank: int, world: int, case: str, entry: str) -> dict[str, object]:
    with poisoned_allocations():
        if case == "unused":
            return unused_sharded(rank, world, entry, True, True)
        return sharded(rank, world, "stack", entry, case)


@pytest.mark.parametrize("entry", ["fully_shard", "FSDP"])
def test_no_unwritten_memory_reaches_gradients(pool2: WorkerPool, entry: str) -> None:
    """With every new buffer NaN, unused and frozen parameters and the rest still train as unsharded."""
    check_unused(pool2.run(poisoned, "unused", entry))
    check_matches_reference(pool2.run(poisoned, "freeze_weights", entry), "stack", "freeze_weights")

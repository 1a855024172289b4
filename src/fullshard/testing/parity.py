"""Training runs to compare: single-process on the full batch (the reference) and sharded across ranks.

Every rank of a sharded run trains on its contiguous slice of the same global batch that the reference
trains on whole, so with gradient averaging the two must agree up to floating-point reassociation.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.engine import FullyShardedDataParallel, ModuleWrapPolicy, fully_shard, summon_full_params
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch

__all__ = [
    "RunResult",
    "TrainSpec",
    "fully_shard_blocks",
    "invariant_gpt",
    "reference_run",
    "sharded_run",
    "without_sync",
]


@dataclass(frozen=True)
class TrainSpec:
    """What to train: model sizes, steps, global batch, learning rate, micro-batches per step, clipping."""

    cfg: GPTConfig = field(default_factory=GPTConfig)
    steps: int = 3
    batch: int = 8
    lr: float = 1e-2
    accumulate: int = 1
    clip: float | None = None
    clip_norm_type: float = 2.0
    seed: int = 0
    optimizer: str = "adamw"
    compute_dtype: torch.dtype | None = None  # the reference computes in this dtype (mixed precision)

    def make_optimizer(self, params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(params, lr=self.lr)

    def model(self) -> TinyGPT:
        torch.manual_seed(self.seed)
        return TinyGPT(self.cfg)

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, y = make_batch(self.cfg, self.batch * self.accumulate, seed=1000 * self.seed + step)
        return [
            (x[i * self.batch : (i + 1) * self.batch], y[i * self.batch : (i + 1) * self.batch])
            for i in range(self.accumulate)
        ]


@dataclass
class RunResult:
    losses: list[float]
    params: dict[str, torch.Tensor]
    grad_norms: list[float]


def reference_run(spec: TrainSpec) -> RunResult:
    """Single process, full batch; gradients of micro-batches averaged like the sharded run's.

    With ``spec.compute_dtype``, each step computes with a copy of the float32 model cast to that dtype
    (no autocast) and hands its gradients, cast back, to the float32 optimizer: the casts mixed precision
    makes, done by hand.
    """
    model = spec.model()
    opt = spec.make_optimizer(model.parameters())
    losses, norms = [], []
    for step in range(spec.steps):
        total = 0.0
        compute = model if spec.compute_dtype is None else copy.deepcopy(model).to(spec.compute_dtype)
        for x, y in spec.micro_batches(step):
            loss = compute(x, y) / spec.accumulate
            loss.backward()
            total += loss.item()
        if compute is not model:
            for master, low in zip(model.parameters(), compute.parameters()):
                master.grad = None if low.grad is None else low.grad.to(master.dtype)
        if spec.clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip, spec.clip_norm_type)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return RunResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms)


def sharded_run(
    rank: int,
    world: int,
    spec: TrainSpec,
    shard: Callable[[nn.Module], nn.Module],
    *,
    use_no_sync: bool = False,
    clip: Callable[[nn.Module, float, float], torch.Tensor] | None = None,
) -> RunResult:
    """Train ``shard(model)`` on this rank's slice of every batch; return losses and gathered parameters."""
    model = shard(spec.model())
    opt = spec.make_optimizer(model.parameters())
    per = spec.batch // world
    losses, norms = [], []
    for step in range(spec.steps):
        total = torch.zeros(())
        micro = spec.micro_batches(step)
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            ctx = without_sync(model) if use_no_sync and not last else contextlib.nullcontext()
            with ctx:
                loss = model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]) / spec.accumulate
                loss.backward()
            total += loss.detach().float()
        if spec.clip is not None and clip is not None:
            norms.append(float(clip(model, spec.clip, spec.clip_norm_type)))
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    with summon_full_params(model, writeback=False):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return RunResult(losses, params, norms)


@contextlib.contextmanager
def without_sync(model: nn.Module) -> Iterator[None]:
    """``no_sync()`` for a wrapper, ``set_requires_gradient_sync(False)`` for a ``fully_shard`` module."""
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def fully_shard_blocks(model: nn.Module, *, shard: Callable[..., nn.Module] = fully_shard, **kwargs: Any) -> nn.Module:
    """``shard`` (fullshard's ``fully_shard`` by default, or a peer's with the same signature) each of
    ``model.blocks`` and then ``model`` itself, all with ``kwargs``; return it."""
    for block in model.blocks:
        shard(block, **kwargs)
    return shard(model, **kwargs)


def invariant_gpt(entry: str, cfg: GPTConfig, micro_batches: int, seed: int) -> nn.Module:
    """``TinyGPT(cfg)`` initialised from ``seed``, one unit per block plus the root, in world-size-invariant mode
    with ``micro_batches`` (G): through ``fully_shard`` when ``entry == "fully_shard"``, else the FSDP class."""
    torch.manual_seed(seed)
    model = TinyGPT(cfg)
    if entry == "fully_shard":
        for block in model.blocks:
            fully_shard(block, invariant_micro_batches=micro_batches)
        return fully_shard(model, invariant_micro_batches=micro_batches)
    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({Block}), invariant_micro_batches=micro_batches
    )

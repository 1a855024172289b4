"""The systems the benchmarks compare, built one way for every script: fullshard's two entry points beside torch's.

A :class:`System` wraps a freshly built ``TinyGPT`` (one unit per ``Block``) and says which sharding strategy
its traffic follows, whether it computes in bf16, which environment it runs under, and how it skips gradient
synchronisation (``no_sync()`` or ``set_requires_gradient_sync(False)``). :func:`system` looks one up by the
name the scripts print and take on ``--systems``; ``" +AC"`` after a name checkpoints every block first.

This is the only place the benchmarks import torch's FSDP (``src/`` may not). What the benchmarks measure with
(the machine description, the RSS sampler, starting ranks) is :mod:`fullshard.testing.bench`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch import nn

from fullshard import FullyShardedDataParallel as OurFSDP
from fullshard import MixedPrecision
from fullshard.algorithms.checkpointing import checkpoint_module
from fullshard.engine.collective_check import CHECK_VAR
from fullshard.engine.p2p import ENV_VAR as P2P_ENV_VAR
from fullshard.testing.models import Block
from fullshard.testing.parity import fully_shard_blocks, without_sync
from fullshard.wrap import ModuleWrapPolicy

BF16_MP = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


# --- builders: each takes the model and returns it wrapped ------------------------------------------------


def ours_fsdp(
    model: nn.Module,
    strategy: str = "FULL_SHARD",
    mixed_precision: MixedPrecision | None = None,
    prefetch: str = "default",
) -> nn.Module:
    """fullshard's ``FullyShardedDataParallel``; prefetch "none" (gather on demand), "default"
    (BACKWARD_PRE) or "all" (+ forward prefetch)."""
    return OurFSDP(
        model,
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        mixed_precision=mixed_precision,
        backward_prefetch=None if prefetch == "none" else "BACKWARD_PRE",
        forward_prefetch=prefetch == "all",
    )


def ours_fully_shard(model: nn.Module, bf16: bool = False) -> nn.Module:
    from fullshard import MixedPrecisionPolicy

    kwargs = (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)} if bf16 else {}
    )
    return fully_shard_blocks(model, **kwargs)


def torch_fsdp2(model: nn.Module, bf16: bool = False) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)} if bf16 else {}
    )
    return fully_shard_blocks(model, shard=fully_shard, reshard_after_forward=True, **kwargs)


def torch_fsdp1(model: nn.Module, strategy: str = "FULL_SHARD", bf16: bool = False) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    mp = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None
    return FullyShardedDataParallel(
        model,
        mixed_precision=mp,
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=TorchPolicy({Block}),
        use_orig_params=True,
        # FSDP1 refuses CPU unless told explicitly; on a GPU, the model's device
        device_id=next(model.parameters()).device,
    )


def ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


# --- the registry --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class System:
    """One system to compare: how to wrap a model, and what to expect of it."""

    name: str
    wrap: Callable[[nn.Module], nn.Module]
    strategy: str = "FULL_SHARD"  # whose traffic formula applies: FULL_SHARD 3x, SHARD_GRAD_OP and NO_SHARD 2x
    bf16: bool = False  # computes (and communicates) in bf16
    env: dict[str, str] = field(default_factory=dict)  # set while it is built and while it steps
    checkpointed: bool = False  # every block under activation checkpointing

    def build(self, model: nn.Module) -> nn.Module:
        if self.checkpointed:
            for block in model.blocks:
                checkpoint_module(block)
        with self.environment():
            return self.wrap(model)

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        with mock.patch.dict(os.environ, self.env):
            yield

    @staticmethod
    def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient synchronisation: ``no_sync()`` (FSDP class, DDP) or ``set_requires_gradient_sync``."""
        return without_sync(model)


# Rows with this suffix run with gloo's own reduce-scatter and all-gather; the others with the engine's choice.
GLOO_NATIVE = ", gloo collectives"
_GLOO = {P2P_ENV_VAR: "0"}
# ... and with this suffix without the header that checks ranks are in step (see engine/collective_check.py):
# the check's cost is the ratio of the two rows.
UNCHECKED = ", unchecked"
_UNCHECKED = {CHECK_VAR: "0"}

SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("fullshard FSDP FULL_SHARD", ours_fsdp),
        System("fullshard FSDP SHARD_GRAD_OP", functools.partial(ours_fsdp, strategy="SHARD_GRAD_OP"), "SHARD_GRAD_OP"),
        System("fullshard FSDP NO_SHARD", functools.partial(ours_fsdp, strategy="NO_SHARD"), "NO_SHARD"),
        System("fullshard fully_shard", ours_fully_shard),
        System("torch FSDP2 fully_shard", torch_fsdp2),
        System("torch FSDP1 FULL_SHARD", torch_fsdp1),
        System("torch DDP", ddp, "NO_SHARD"),
        System(f"fullshard FSDP FULL_SHARD{GLOO_NATIVE}", ours_fsdp, env=_GLOO),
        System(f"fullshard fully_shard{GLOO_NATIVE}", ours_fully_shard, env=_GLOO),
        System(f"fullshard FSDP FULL_SHARD{UNCHECKED}", ours_fsdp, env=_UNCHECKED),
        System(f"fullshard fully_shard{UNCHECKED}", ours_fully_shard, env=_UNCHECKED),
        System(
            "fullshard FSDP bf16, no prefetch",
            functools.partial(ours_fsdp, mixed_precision=BF16_MP, prefetch="none"),
            bf16=True,
        ),
        System(
            "fullshard FSDP bf16, backward prefetch", functools.partial(ours_fsdp, mixed_precision=BF16_MP), bf16=True
        ),
        System(
            "fullshard FSDP bf16, fwd+bwd prefetch",
            functools.partial(ours_fsdp, mixed_precision=BF16_MP, prefetch="all"),
            bf16=True,
        ),
        System("fullshard fully_shard bf16", functools.partial(ours_fully_shard, bf16=True), bf16=True),
        System("torch FSDP2 bf16", functools.partial(torch_fsdp2, bf16=True), bf16=True),
        System("torch FSDP1 bf16", functools.partial(torch_fsdp1, bf16=True), bf16=True),
    )
}
# Short names (``train.py memory`` and its results use them): the FULL_SHARD system of each entry point.
ALIASES = {"fullshard FSDP": "fullshard FSDP FULL_SHARD", "torch FSDP2": "torch FSDP2 fully_shard"}
AC_SUFFIX = " +AC"


def system(name: str) -> System:
    """The system called ``name`` (a key of SYSTEMS or ALIASES), under that name; ``" +AC"`` at the end
    checkpoints every block before wrapping."""
    checkpointed = name.endswith(AC_SUFFIX)
    base = name.removesuffix(AC_SUFFIX)
    found = SYSTEMS.get(ALIASES.get(base, base))
    if found is None:
        known = ", ".join(repr(n) for n in [*SYSTEMS, *ALIASES])
        raise ValueError(f"system {name!r} is unknown: expected one of {known}, optionally followed by {AC_SUFFIX!r}")
    return System(name, found.wrap, found.strategy, found.bf16, found.env, checkpointed)

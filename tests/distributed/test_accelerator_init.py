"""How ``Accelerator.prepare`` initialises a model on 2 gloo ranks: RAM-efficient loading and ``param_init_fn``.

Set up: TinyGPT with 4 blocks. For ``cpu_ram_efficient_loading`` rank 0 builds the real model (the
"pretrained weights") and rank 1 builds it on the ``meta`` device.
Run: ``prepare`` with each ``fsdp_version``, watching rank 1's live parameter elements at every broadcast.
Check: rank 1 never holds the whole model (at most one unit in full plus the shards already made), and the
sharded result equals rank 0's weights. ``param_init_fn`` materializes meta modules under ``fully_shard`` too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fullshard import Accelerator, FullyShardedDataParallelPlugin
from fullshard.testing import RankFailure, WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT

CFG = GPTConfig(n_layer=4)


def _plugin(version: int, **kwargs: Any) -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(
        fsdp_version=version,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        **kwargs,
    )


def _live_numel(model: nn.Module) -> int:
    """Parameter elements this rank holds right now (local shards of sharded ones; meta ones hold none)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return sum(t.numel() for t in local if not t.is_meta)


@contextlib.contextmanager
def restoring_environ() -> Iterator[None]:
    """The plugin exports FSDP_CPU_RAM_EFFICIENT_LOADING into ``os.environ``: keep the pool's ranks clean."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def load_ram_efficiently(rank: int, world: int, version: int) -> dict[str, Any]:
    with restoring_environ():
        accelerator = Accelerator(fsdp_plugin=_plugin(version, cpu_ram_efficient_loading=True))
        if rank == 0:
            torch.manual_seed(3)
            model = TinyGPT(CFG)
        else:
            with torch.device("meta"):
                model = TinyGPT(CFG)
        on_meta = {p.is_meta for p in model.parameters()}
        peaks: list[int] = []
        broadcast = dist.broadcast

        def watching(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            peaks.append(_live_numel(model))
            return broadcast(tensor, *args, **kwargs)

        dist.broadcast = watching
        try:
            model = accelerator.prepare(model)
        finally:
            dist.broadcast = broadcast
        return {"on_meta": on_meta, "peak": max(peaks), "state": accelerator.get_state_dict(model)}


@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
def test_ram_efficient_loading_never_materializes_the_model_on_other_ranks(pool2: WorkerPool, version: int) -> None:
    rank0, rank1 = pool2.run(load_ram_efficiently, version)
    torch.manual_seed(3)
    want = TinyGPT(CFG).state_dict()
    total = sum(t.numel() for t in want.values())
    block = sum(p.numel() for p in TinyGPT(CFG).blocks[0].parameters())
    assert rank0["on_meta"] == {False} and rank1["on_meta"] == {True}
    # One unit in full plus half of the rest at most; loading the whole model first would reach `total`.
    assert block <= rank1["peak"] <= block + (total - block) / 2 + 8, (rank1["peak"], total)
    assert rank1["state"] == {}
    assert rank0["state"].keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(rank0["state"][name], tensor, atol=0, rtol=0, msg=name)


def fill_with_rank(module: nn.Module) -> None:
    """A ``param_init_fn``: real storage for this module's own tensors, filled with ``rank + 0.5``."""
    module.to_empty(device=torch.device("cpu"), recurse=False)
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            param.fill_(dist.get_rank() + 0.5)


def init_on_meta(rank: int, world: int, version: int, sync: bool) -> dict[str, torch.Tensor]:
    with restoring_environ():
        options = {"param_init_fn": fill_with_rank, "sync_module_states": sync, "cpu_ram_efficient_loading": False}
        plugin = _plugin(version, **options)
        accelerator = Accelerator(fsdp_plugin=plugin)
        with torch.device("meta"):
            model = TinyGPT(CFG)
        return accelerator.get_state_dict(accelerator.prepare(model))


@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
def test_param_init_fn_materializes_meta_modules(pool2: WorkerPool, version: int) -> None:
    state = pool2.run(init_on_meta, version, False)[0]
    values = {v for t in state.values() for v in t.unique().tolist()}
    assert values == {0.5, 1.5}, "each rank initialised (and kept) its own shard"
    state = pool2.run(init_on_meta, version, True)[0]
    assert {v for t in state.values() for v in t.unique().tolist()} == {0.5}, "sync_module_states: rank 0's values"


class Scale(nn.Module):
    """A module with a parameter and no ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def prepare_broken(rank: int, world: int, version: int, problem: str) -> None:
    with restoring_environ():
        accelerator = Accelerator(fsdp_plugin=_plugin(version, cpu_ram_efficient_loading=True))
        if problem == "shapes":
            model = TinyGPT(GPTConfig(n_layer=2 + rank))
        else:  # every rank on meta, rank 0 included, and a module that cannot initialise itself
            with torch.device("meta"):
                model = nn.Sequential(Block(CFG), Scale())
        accelerator.prepare(model)


@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
@pytest.mark.parametrize(
    "problem, message",
    [
        ("shapes", "sync_module_states=True (model=TinyGPT): rank 1 built a different model than rank 0 (first "
                   "difference: ('blocks.2.ln_1.weight', (15,)) vs rank 0's ('ln_f.weight', (15,)))."),
        ("meta", "sync_module_states=True (model=Sequential): on rank 0, ['1'] are on the meta device and have no "
                 "reset_parameters()"),
    ],
)  # fmt: skip
def test_sync_problems_raise_on_every_rank_before_any_broadcast(
    pool2: WorkerPool, version: int, problem: str, message: str
) -> None:
    with pytest.raises(RankFailure) as info:
        pool2.run(prepare_broken, version, problem)
    assert sorted(info.value.failures) == [0, 1]
    for traceback in info.value.failures.values():
        assert message in traceback

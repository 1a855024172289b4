"""algorithms.full_load: a full state dict that only rank 0 holds loads into either entry point's shards, bitwise.

Set up: TinyGPT with tied embedding/head, a buffer and (FSDP) an ignored module, built with other values.
Run: rank 0 passes the reference model's state_dict(), rank 1 passes None.
Check: every rank's gathered FULL state dict equals the reference bitwise; a dict that does not fit raises the
same ValueError on every rank and leaves the model unchanged.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fullshard import FSDP, fully_shard
from fullshard.algorithms.full_load import load_full_state_dict
from fullshard.frontend.saving.model_state import full_model_state_dict
from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT
from fullshard.wrap import ModuleWrapPolicy

CFG = GPTConfig(tie_weights=True)


class WithExtras(TinyGPT):
    def __init__(self) -> None:
        super().__init__(CFG)
        self.side = nn.Linear(3, 2)  # ignored by FSDP: whole on every rank
        self.register_buffer("scale", torch.arange(5.0))


def reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(11)
    model = WithExtras()
    model.scale.mul_(3)
    return model.state_dict()


def _sharded(entry: str) -> nn.Module:
    torch.manual_seed(5)
    model = WithExtras()
    if entry == "fsdp":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), ignored_modules=[model.side])
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def load(rank: int, world: int, entry: str, broken: bool) -> tuple[str, dict[str, torch.Tensor]]:
    model = _sharded(entry)
    full = reference() if rank == 0 else None
    if broken and full is not None:
        full["blocks.0.fc.weight"] = full["blocks.0.fc.weight"][:, :-1]
        full["extra"] = torch.zeros(1)
    try:
        load_full_state_dict(model, full, strict=True, caller="test")
        error = ""
    except ValueError as exc:
        error = str(exc)
    return error, full_model_state_dict(model)


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_full_state_dict_from_rank0_loads_bitwise(pool2: WorkerPool, entry: str) -> None:
    want = reference()
    results = pool2.run(load, entry, False)
    assert [error for error, _ in results] == ["", ""]
    got = results[0][1]
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_a_full_state_dict_that_does_not_fit_raises_everywhere_untouched(pool2: WorkerPool) -> None:
    results = pool2.run(load, "fsdp", True)
    for error, _ in results:
        assert error.startswith("test: rank 0's full state dict does not fit the model: missing keys [], "), error
        assert "unexpected keys ['extra']" in error and "'blocks.0.fc.weight'" in error and "strict=False" in error
    torch.manual_seed(5)
    untouched = WithExtras().state_dict()
    for key, value in results[0][1].items():
        assert torch.equal(value, untouched[key]), key

"""Checkpoints interoperate with torch's FSDP2 through torch.distributed.checkpoint, model and optimizer.

Set up: TinyGPT (tied weights) and AdamW over two param groups, K steps on 2 gloo ranks under torch's
``fully_shard``, saved as Accelerate does it: ``dcp.save({"model": get_model_state_dict(m)})`` into
``pytorch_model_fsdp_0/`` and ``dcp.save({"optimizer": get_optimizer_state_dict(m, o)})`` into ``optimizer_0/``.
Run: a fresh fullshard model (``fully_shard`` or the wrapper) loads both with ``load_sharded`` and trains M more
steps; the other way round, torch's FSDP2 loads a fullshard checkpoint with ``dcp.load`` and its own
``set_model_state_dict`` / ``set_optimizer_state_dict``.
Check: the loading side's outputs on a fixed batch equal the saving side's, its full state equals the saved
one bitwise, and its next losses equal the saving side's next losses (fp32 tolerance: two engines).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, make_batch
from tests.distributed.test_checkpoint_reshard import (
    CFG,
    K,
    M,
    assert_same_state,
    full_states,
    load_into,
    make,
    make_optim,
    save,
    shard,
    train,
)


def _torch_shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.modules():
        if isinstance(block, Block):
            fully_shard(block)
    return fully_shard(model)


def _outputs(model: nn.Module) -> torch.Tensor:
    x, _ = make_batch(CFG, 2, seed=123)
    with torch.no_grad():
        return model(x).detach().clone()


def _torch_full_states(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    weights, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    cloned = {k: v.clone() for k, v in weights.items()}
    state = {n: {k: v.clone() for k, v in s.items()} for n, s in osd["state"].items()}
    return cloned, {"state": state, "param_groups": osd["param_groups"]}


def torch_save(rank: int, world: int, root: str) -> tuple[Any, ...]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = _torch_shard(make())
    opt = make_optim(model)
    train(model, opt, range(K))
    writer = dcp.FileSystemWriter
    dcp.save({"model": get_model_state_dict(model)}, storage_writer=writer(f"{root}/pytorch_model_fsdp_0"))
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, storage_writer=writer(f"{root}/optimizer_0"))
    saved = (_outputs(model), *_torch_full_states(model, opt))
    return (*saved, train(model, opt, range(K, K + M)))


def ours_load(rank: int, world: int, layout: str, root: str) -> tuple[Any, ...]:
    model = shard(make(seed=9), layout)
    opt = make_optim(model, lr_scale=10.0)
    load_into(model, opt, root)
    loaded = (_outputs(model), *full_states(model, opt))
    return (*loaded, train(model, opt, range(K, K + M)))


def torch_load(rank: int, world: int, root: str) -> tuple[Any, ...]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = _torch_shard(make(seed=9))
    opt = make_optim(model, lr_scale=10.0)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(f"{root}/pytorch_model_fsdp_0"))
    set_model_state_dict(model, state["model"])
    state = {"optimizer": get_optimizer_state_dict(model, opt)}  # creates the state of a fresh optimizer
    dcp.load(state, storage_reader=dcp.FileSystemReader(f"{root}/optimizer_0"))
    set_optimizer_state_dict(model, opt, state["optimizer"])
    loaded = (_outputs(model), *_torch_full_states(model, opt))
    return (*loaded, train(model, opt, range(K, K + M)))


def ours_save(rank: int, world: int, layout: str, root: str) -> tuple[Any, ...]:
    losses, weights, osd = save(rank, world, layout, root)
    return losses, weights, osd


def ours_continue(rank: int, world: int, layout: str, root: str) -> tuple[Any, ...]:
    model = shard(make(seed=9), layout)
    opt = make_optim(model, lr_scale=10.0)
    load_into(model, opt, root)
    return _outputs(model), train(model, opt, range(K, K + M))


def _check(loaded: tuple[Any, ...], saved: tuple[Any, ...]) -> None:
    outputs, weights, osd, losses = loaded
    want_outputs, want_weights, want_osd, want_losses = saved
    assert torch.equal(outputs, want_outputs), "the same outputs on a fixed batch"
    assert_same_state((weights, osd), (want_weights, want_osd))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["fully_shard", "FULL_SHARD"])
def test_torch_fsdp2_checkpoint_loads_into_fullshard(pool2: WorkerPool, tmp_path: Path, layout: str) -> None:
    # - Set up: torch's FSDP2 trains K steps and saves
    saved = pool2.run(torch_save, str(tmp_path))
    # - Run / Check: fullshard loads on the same ranks and goes on as torch did
    for loaded, want in zip(pool2.run(ours_load, layout, str(tmp_path)), saved, strict=True):
        _check(loaded, want)


@pytest.mark.parametrize("layout", ["fully_shard", "FULL_SHARD"])
def test_fullshard_checkpoint_loads_into_torch_fsdp2(pool2: WorkerPool, tmp_path: Path, layout: str) -> None:
    # - Set up: fullshard trains K steps and saves; the same checkpoint resumed by fullshard is the yardstick
    saved = pool2.run(ours_save, layout, str(tmp_path))
    ours = pool2.run(ours_continue, layout, str(tmp_path))
    # - Run / Check: torch's FSDP2 loads it: the state fullshard saved, the outputs and losses it goes on with
    for loaded, (_, weights, osd), (outputs, losses) in zip(pool2.run(torch_load, str(tmp_path)), saved, ours):
        _check(loaded, (outputs, weights, osd, losses))

"""A forward without backward (evaluation, a sanity check) before the optimizer is built.

After it, ``parameters()`` and ``named_parameters()`` must yield the sharded leaf parameters with their
``requires_grad``, so that an optimizer built then steps on what the engine gathers: training must match the
single-process reference. Both entry points, parameters freed after forward or kept (FULL_SHARD /
SHARD_GRAD_OP, ``reshard_after_forward``), under ``torch.no_grad()`` and with autograd on.

One case follows torch instead: with autograd on, a ``fully_shard`` unit kept gathered (``reshard_after_forward=False``,
or the root by default) leaves its gathered tensors registered until it reshards, as torch's ``fully_shard`` does
(``tests/compat/test_fsdp2_surface.py::test_param_registration_after_forward_as_torch``); here they are non-leaf
views, so an optimizer built from them fails loudly (torch's are leaves: an optimizer built then never updates the
shards), and ``reshard()`` on each unit, or ``state_dict()``, brings the sharded parameters back. Torch FSDP1's
SHARD_GRAD_OP yields non-leaf views too; the FSDP wrapper here registers the sharded parameters again
(``test_torch_peers_expose_gathered_parameters_after_forward`` records both peers).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard import FSDP, FSDPModule, ShardingStrategy
from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, make_batch
from fullshard.testing.parity import RunResult, TrainSpec, fully_shard_blocks, reference_run, sharded_run
from fullshard.wrap import ModuleWrapPolicy

SPEC = TrainSpec()


def shard_then_forward(model: nn.Module, entry: str, keep_gathered: bool, grad_enabled: bool) -> nn.Module:
    """Shard ``model``, run one forward with no backward, and check what ``named_parameters()`` yields."""
    names = [n for n, _ in model.named_parameters()]
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    if entry == "fsdp":
        strategy = ShardingStrategy.SHARD_GRAD_OP if keep_gathered else ShardingStrategy.FULL_SHARD
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy)
    else:
        model = fully_shard_blocks(model, reshard_after_forward=not keep_gathered)
    sharded = dict(model.named_parameters())
    x, _ = make_batch(SPEC.cfg, 2, seed=99)
    with torch.set_grad_enabled(grad_enabled):
        model(x)
    if entry == "fully_shard" and keep_gathered and grad_enabled:  # torch's registration: gathered until reshard()
        kept = list(model.parameters())
        assert not any(isinstance(p, DTensor) or p.is_leaf for p in kept), [type(p) for p in kept]
        with pytest.raises(ValueError, match="non-leaf"):
            torch.optim.SGD(kept, lr=0.1)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    after = dict(model.named_parameters())
    assert list(after) == names, (list(after), names)
    for name, param in after.items():
        assert param is sharded[name], f"{name}: not the sharded parameter after forward"
        assert param.is_leaf and isinstance(param, nn.Parameter), name
        assert param.requires_grad == flags[name], name
        assert isinstance(param, DTensor) == (entry == "fully_shard"), name
    assert [id(p) for p in model.parameters()] == [id(p) for p in after.values()]
    return model


def run(rank: int, world: int, shard: functools.partial) -> RunResult:
    return sharded_run(rank, world, SPEC, shard)


@pytest.fixture(scope="module")
def reference() -> RunResult:
    return reference_run(SPEC)


@pytest.mark.parametrize("grad_enabled", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("keep_gathered", [False, True], ids=["reshard", "keep_gathered"])
@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_optimizer_built_after_a_forward_trains(
    pool2: WorkerPool, reference: RunResult, entry: str, keep_gathered: bool, grad_enabled: bool
) -> None:
    shard = functools.partial(shard_then_forward, entry=entry, keep_gathered=keep_gathered, grad_enabled=grad_enabled)
    for got in pool2.run(run, shard):
        torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(reference.losses), atol=1e-5, rtol=1e-5)
        for name, want in reference.params.items():
            torch.testing.assert_close(got.params[name], want, atol=2e-5, rtol=1e-4, msg=name)


def torch_after_forward(rank: int, world: int) -> dict[str, list[bool]]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    x = torch.randn(2, 4)
    fsdp2 = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    torch_fully_shard(fsdp2[0])
    torch_fully_shard(fsdp2)
    fsdp2(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fsdp1 = TorchFSDP(
            nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)),
            sharding_strategy=TorchStrategy.SHARD_GRAD_OP,
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
    fsdp1(x)
    return {
        "fsdp2_dtensor": [isinstance(p, DTensor) for p in fsdp2.parameters()],
        "fsdp1_leaf": [p.is_leaf for p in fsdp1.parameters()],
    }


def test_torch_peers_expose_gathered_parameters_after_forward(pool2: WorkerPool) -> None:
    got = pool2.run(torch_after_forward)[0]
    assert got["fsdp2_dtensor"] == [True, True, False, False]  # the root's unsharded parameters stay registered
    assert got["fsdp1_leaf"] == [False] * 4

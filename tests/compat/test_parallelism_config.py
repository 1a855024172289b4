"""Accelerate's ParallelismConfig on 4 gloo ranks, against torch's FSDP2 on the same model and mesh.

Set up: ``Accelerator(parallelism_config=ParallelismConfig(...))`` builds the mesh (``accelerator.torch_device_mesh``);
TinyGPT's blocks are made tensor parallel over ``mesh["tp"]`` with torch's ``parallelize_module`` (``fc``
column-wise, ``fc_out`` row-wise) before ``prepare``. The reference builds the same model on the same mesh, the
same plan, and torch's ``fully_shard`` on each block and the root over ``mesh[fsdp_dim_names]``, fed the same
batches by hand (the global batch of the data parallel ranks, each dp rank its slice).

Cases: dp_shard=2 x tp=2 (clipped), and dp_replicate=2 x dp_shard=2 (HSDP). Accelerate itself runs neither on
CPU: it sets ``DistributedType.FSDP`` only on accelerators (so gloo ranks never shard), and its FSDP2 + TP
``prepare`` imports ``ReplicateParallel`` from transformers, which transformers 5.24 no longer has.

Check: losses, clipped gradient norms and final parameters equal torch FSDP2's; the ranks of one tp group were
given the same batches and the two dp groups different ones; the parameters the plan left plain are sharded
over dp_shard and replicated over tp (``(Shard(0), Replicate())`` on ``("dp_shard_cp", "tp")``); a model of
another tensor parallel size, or none, is refused; ``cp_size > 1`` is refused by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from fullshard import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
from fullshard.testing import WorkerPool
from fullshard.testing.models import GPTConfig, TinyGPT

CFG = GPTConfig()
PER_RANK, STEPS, CLIP = 2, 3, 0.05


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, CFG.vocab_size, (32, CFG.block_size + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


def _model(tp_mesh: Any) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    if tp_mesh is not None:
        for block in model.blocks:
            plan = {"fc": ColwiseParallel(use_local_output=False), "fc_out": RowwiseParallel()}
            parallelize_module(block, tp_mesh, plan)
    return model


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _torch_norm_and_clip(model: torch.nn.Module) -> float:
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    norm = float(torch.stack([g.norm() for g in grads if g is not None]).norm())
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(min(1.0, CLIP / (norm + 1e-6)))
    return norm


def train_both(rank: int, world: int, sizes: dict[str, int], clip: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    config = ParallelismConfig(**sizes)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
    )
    accelerator = Accelerator(parallelism_config=config, fsdp_plugin=plugin)
    mesh = accelerator.torch_device_mesh
    tp_mesh = mesh["tp"] if config.tp_enabled else None
    model = _model(tp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_dataset(), batch_size=PER_RANK)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    out: dict[str, Any] = {"losses": [], "norms": [], "batches": [], "mesh": mesh.mesh_dim_names}
    for _, (x, y) in zip(range(STEPS), loader):
        loss = model(x, y)
        accelerator.backward(loss)
        if clip:
            out["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss.item())
        out["batches"].append(x.clone())
    wte = dict(model.named_parameters())["wte.weight"]
    out["wte"] = (tuple(wte.placements), wte.device_mesh.mesh_dim_names)
    out["params"] = _full(model)

    # torch's FSDP2 on the same mesh: the same plan, fully_shard over mesh[fsdp_dim_names], the same batches.
    model = _model(tp_mesh)
    fsdp_mesh = mesh[tuple(config.fsdp_dim_names)]
    for block in model.blocks:
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp, n_dp = rank // config.tp_size, config.data_parallel_size
    global_batches = DataLoader(_dataset(), batch_size=PER_RANK * n_dp)
    out["torch_losses"], out["torch_norms"], out["torch_batches"] = [], [], []
    for _, (x, y) in zip(range(STEPS), global_batches):
        x, y = x[dp * PER_RANK : (dp + 1) * PER_RANK], y[dp * PER_RANK : (dp + 1) * PER_RANK]
        loss = model(x, y)
        loss.backward()
        if clip:
            out["torch_norms"].append(_torch_norm_and_clip(model))
        optimizer.step()
        optimizer.zero_grad()
        out["torch_losses"].append(loss.item())
        out["torch_batches"].append(x)
    out["torch_params"] = _full(model)
    return out


@pytest.mark.parametrize(
    ("sizes", "clip", "mesh"),
    [
        ({"dp_shard_size": 2, "tp_size": 2}, True, ("dp_shard", "tp")),
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, False, ("dp_replicate", "dp_shard")),
    ],
    ids=["dp_shard2-tp2", "hsdp-2x2"],
)
def test_training_equals_torch_fsdp2(pool4: WorkerPool, sizes: dict[str, int], clip: bool, mesh: tuple) -> None:
    results = pool4.run(train_both, sizes, clip)
    for result in results:
        assert result["mesh"] == mesh
        torch.testing.assert_close(result["losses"], result["torch_losses"], atol=1e-5, rtol=1e-5)
        if clip:
            assert result["torch_norms"][0] > CLIP  # the clip really clips
            torch.testing.assert_close(result["norms"], result["torch_norms"], atol=1e-5, rtol=1e-5)
        for name, want in result["torch_params"].items():
            ours = result["params"][name]
            torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        for ours, theirs in zip(result["batches"], result["torch_batches"]):
            assert torch.equal(ours, theirs)
    tp = sizes.get("tp_size", 1)
    for rank in range(4):  # one tp group: the same batches; the next dp rank: others
        same = results[rank - rank % tp]["batches"]
        assert all(torch.equal(a, b) for a, b in zip(results[rank]["batches"], same))
    assert not torch.equal(results[0]["batches"][0], results[tp]["batches"][0])
    if tp > 1:
        assert results[0]["wte"] == ((Shard(0), Replicate()), ("dp_shard_cp", "tp"))


def refusals(rank: int, world: int) -> list[str]:
    """The messages of what a ParallelismConfig refuses on 4 ranks (each raised before any collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    messages = []
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2), fsdp_plugin=plugin)
    with pytest.raises(NotImplementedError) as refused:  # tp_size=2, a model that is not tensor parallel
        accelerator.prepare(_model(None))
    messages.append(str(refused.value))
    other_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "tp"))["tp"]
    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=4), fsdp_plugin=plugin)
    with pytest.raises(ValueError) as refused:  # tensor parallel over 2, configured tp_size=1
        accelerator.prepare(_model(other_tp))
    messages.append(str(refused.value))
    for config, version in ((ParallelismConfig(dp_shard_size=2), 2), (ParallelismConfig(dp_shard_size=4), 1)):
        with pytest.raises(ValueError) as refused:
            Accelerator(parallelism_config=config, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=version))
        messages.append(str(refused.value))
    return messages


def test_refusals(pool4: WorkerPool) -> None:
    for no_tp, other_size, total, version in pool4.run(refusals):
        assert "with tp_size=2: the model is not tensor parallel" in no_tp
        assert "tp_size is 1 but the model is tensor parallel over 2 ranks" in other_size
        assert "total_size 2 (dp_replicate x dp_shard x tp) differs from the 4 processes" in total
        assert "with fsdp_version=1: a ParallelismConfig shards with fully_shard" in version

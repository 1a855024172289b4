"""Tensor parallel blocks under ``fully_shard`` on a 2x2 (dp, tp) mesh, against torch's FSDP2 on the same model.

Set up: 4 gloo ranks, ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``; each block is given a
tensor parallel plan with torch's ``parallelize_module`` on ``mesh["tp"]``, then ``fully_shard(block,
mesh=mesh["dp"])`` for each block and ``fully_shard(model, mesh=mesh["dp"])``. Two plans:

- ``gpt``: TinyGPT's MLP, ``fc`` column-wise and ``fc_out`` row-wise. Its hidden size (61) divides neither tp
  nor dp, so both splits are uneven, and ``fc``'s dim 0 is split by tp and then by dp (``_StridedShard``).
- ``sp``: a small residual MLP net with sequence parallelism: ``PrepareModuleInputOutput`` on each block
  (replicated in, sequence-sharded inside, replicated out), ``SequenceParallel`` on its LayerNorm (tp-replicated
  parameters), ``ColwiseParallel(input_layouts=Shard(1))`` and ``RowwiseParallel(output_layouts=Shard(1))``.

Also on a (1, 2, 2) mesh: hybrid sharding over ("rep", "dp") with tp.

Run / check: losses, gradient norms of ``clip_grad_norm_`` (over both mesh dims) and final parameters equal
torch FSDP2's; sharded and full state dicts hold the trained values, and the full optimizer state dict equals
torch FSDP2's; a full state dict loads into a fresh model and into one built on meta (then ``to_empty``); a
DCP checkpoint loads back into a fresh 2x2 model, into a model sharded over dp=4 without tensor parallelism,
and into torch's FSDP2; the ``FullyShardedDataParallel`` class refuses tensor parallel parameters with a
message naming ``fully_shard``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from fullshard import FullyShardedDataParallel, StateDictType
from fullshard.testing import WorkerPool
from fullshard.testing.parity import TrainSpec

SPEC = TrainSpec(optimizer="adamw", steps=3)
CLIP = 0.05
SEQ, WIDTH, HIDDEN = 4, 6, 10  # the sp net: HIDDEN / tp = 5 rows, split 3 / 2 over dp


class SPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, HIDDEN)
        self.fc_out = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(F.gelu(self.fc(self.norm(x))))


class SPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, WIDTH)
        self.blocks = nn.ModuleList([SPBlock(), SPBlock()])
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.out(h).squeeze(-1), y)


def _sp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(SPEC.batch, SEQ, 3, generator=g), torch.randn(SPEC.batch, SEQ, generator=g)


def _parallelize(model: nn.Module, kind: str, tp_mesh: DeviceMesh) -> None:
    for block in model.blocks:
        if kind == "gpt":
            plan: dict[str, Any] = {"fc": ColwiseParallel(use_local_output=False), "fc_out": RowwiseParallel()}
        else:
            plan = {
                "norm": SequenceParallel(),
                "fc": ColwiseParallel(input_layouts=Shard(1)),
                "fc_out": RowwiseParallel(output_layouts=Shard(1)),
            }
            io = PrepareModuleInputOutput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Shard(1),),
                use_local_input=True,
                output_layouts=(Shard(1),),
                desired_output_layouts=(Replicate(),),
            )
            parallelize_module(block, tp_mesh, io)
        parallelize_module(block, tp_mesh, plan)


def _build(kind: str, impl: str, shape: tuple[int, ...] = (2, 2), seed: int = 0) -> nn.Module:
    """The model, tensor parallel over ``tp`` when ``shape[-1] > 1``, sharded by ``impl`` over ``dp`` (a
    3-D ``shape`` is (replicate, dp, tp): hybrid sharding over ``("rep", "dp")``)."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fullshard import fully_shard
    torch.manual_seed(seed)
    model = SPEC.model() if kind == "gpt" else SPNet()
    names = ("dp", "tp") if len(shape) == 2 else ("rep", "dp", "tp")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if shape[-1] > 1:
        _parallelize(model, kind, mesh["tp"])
    dp_mesh = mesh[names[:-1]] if len(shape) == 3 else mesh["dp"]
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


def _total_norm(model: nn.Module) -> torch.Tensor:
    """The reference norm for torch's FSDP2: the 2-norm of every full gradient (mixed meshes, so by hand)."""
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    return torch.stack([g.norm() for g in grads if g is not None]).norm()


def _clip(model: nn.Module, impl: str) -> float:
    if impl == "torch":
        norm = _total_norm(model)
        coef = min(1.0, CLIP / (float(norm) + 1e-6))
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        return float(norm)
    from fullshard.engine.grad_norm import clip_grad_norm_
    from fullshard.engine.unit_state import unit_states_in

    return float(clip_grad_norm_(unit_states_in(model), [], CLIP))


def _train(
    model: nn.Module, kind: str, impl: str, steps: range, clip: bool
) -> tuple[list[float], list[float], torch.optim.Optimizer]:
    opt = SPEC.make_optimizer(model.parameters())
    dp = torch.distributed.get_rank() // 2
    per = SPEC.batch // 2
    losses, norms = [], []
    for step in steps:
        x, y = SPEC.micro_batches(step)[0] if kind == "gpt" else _sp_batch(step)
        loss = model(x[dp * per : (dp + 1) * per], y[dp * per : (dp + 1) * per])
        loss.backward()
        if clip:
            norms.append(_clip(model, impl))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, opt


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def train_both(rank: int, world: int, kind: str, clip: bool, shape: tuple[int, ...]) -> dict[str, Any]:
    out = {}
    for impl in ("torch", "ours"):
        model = _build(kind, impl, shape)
        losses, norms, _ = _train(model, kind, impl, range(SPEC.steps), clip)
        out[impl] = (losses, norms, _full_params(model))
    return out


@pytest.mark.parametrize(
    ("kind", "clip", "shape"),
    [("gpt", False, (2, 2)), ("gpt", True, (2, 2)), ("sp", True, (2, 2)), ("gpt", True, (1, 2, 2))],
    ids=["gpt", "gpt-clip", "sp-clip", "hsdp-gpt-clip"],
)
def test_training_equals_torch_fsdp2(pool4: WorkerPool, kind: str, clip: bool, shape: tuple[int, ...]) -> None:
    for result in pool4.run(train_both, kind, clip, shape):
        (want_losses, want_norms, want_params), (losses, norms, params) = result["torch"], result["ours"]
        torch.testing.assert_close(losses, want_losses, atol=1e-5, rtol=1e-5)
        assert params.keys() == want_params.keys()
        for name, ref in want_params.items():
            torch.testing.assert_close(params[name], ref, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        if clip:
            assert want_norms[0] > CLIP  # the clip really clips
            torch.testing.assert_close(norms, want_norms, atol=1e-5, rtol=1e-5)


def _state_dicts(model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    sharded = dict(model.state_dict())
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = dict(model.state_dict())
    return sharded, full


def state_dicts_and_dcp(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )

    model = _build("gpt", "ours")
    _, _, opt = _train(model, "gpt", "ours", range(2), clip=False)
    trained = _full_params(model)
    theirs = _build("gpt", "torch")
    _, _, their_opt = _train(theirs, "gpt", "torch", range(2), clip=False)
    full_osd = get_optimizer_state_dict(theirs, their_opt, options=StateDictOptions(full_state_dict=True))
    sharded, full = _state_dicts(model)
    fc, fc_out = sharded["blocks.0.fc.weight"], sharded["blocks.0.fc_out.weight"]
    out: dict[str, Any] = {
        "trained": trained,
        "placements": (tuple(fc.placements), tuple(fc_out.placements), fc.device_mesh.mesh_dim_names),
        "sharded_full": {k: v.full_tensor() for k, v in sharded.items()},
        "full": full,
        "optim": FullyShardedDataParallel.full_optim_state_dict(model, opt, rank0_only=False)["state"],
        "torch_optim": full_osd["state"],
    }
    fresh = _build("gpt", "ours", seed=9)
    fresh.load_state_dict(full)
    out["loaded_full"] = _full_params(fresh)
    fresh = _build("gpt", "ours", seed=9)
    fresh.load_state_dict(sharded)
    out["loaded_sharded"] = _full_params(fresh)
    with torch.device("meta"):  # torchtitan's order: tp plan and sharding on meta, then to_empty and load
        fresh = _build("gpt", "ours", seed=9)
    fresh.to_empty(device="cpu")
    fresh.load_state_dict(full)
    out["meta_loaded_full"] = _full_params(fresh)

    dcp.save(sharded, checkpoint_id=root)
    for shape in ((2, 2), (4, 1)):  # the same mesh; dp=4 without tensor parallelism
        fresh = _build("gpt", "ours", shape=shape, seed=9)
        target = fresh.state_dict()
        dcp.load(target, checkpoint_id=root)
        fresh.load_state_dict(target)
        out[f"dcp_{shape}"] = _full_params(fresh)
    theirs = _build("gpt", "torch", seed=9)
    target = get_model_state_dict(theirs)
    dcp.load(target, checkpoint_id=root)
    set_model_state_dict(theirs, target)
    out["dcp_torch"] = _full_params(theirs)
    return out


def test_state_dicts_and_dcp_checkpoints(pool4: WorkerPool, tmp_path: Path) -> None:
    results = pool4.run(state_dicts_and_dcp, str(tmp_path / "ckpt"))
    for result in results:
        trained = result["trained"]
        fc, fc_out, names = result["placements"]
        assert names == ("dp", "tp")
        assert fc == (_StridedShard(0, split_factor=2), Shard(0))  # dp splits each tp shard of fc's rows
        assert fc_out == (Shard(0), Shard(1))
        assert result["full"].keys() == result["sharded_full"].keys() >= trained.keys()
        assert result["optim"].keys() == result["torch_optim"].keys() == trained.keys()
        for name, want in result["torch_optim"].items():
            for state in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(result["optim"][name][state], want[state], atol=1e-5, rtol=1e-5)
        loaded = ("loaded_full", "loaded_sharded", "meta_loaded_full", "dcp_(2, 2)", "dcp_(4, 1)", "dcp_torch")
        for key in ("sharded_full", "full", *loaded):
            for name, want in trained.items():
                torch.testing.assert_close(result[key][name], want, atol=0, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    # merge-weights streams the 2-D sharded checkpoint into one file of full tensors.
    from safetensors.torch import load_file

    from fullshard.utils import merge_fsdp_weights

    merge_fsdp_weights(str(tmp_path / "ckpt"), str(tmp_path / "merged"))
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    trained = results[0]["trained"]
    assert trained.keys() <= merged.keys()
    for name, want in trained.items():
        torch.testing.assert_close(merged[name], want, atol=0, rtol=0, msg=name)


def refusals(rank: int, world: int) -> list[str]:
    """The messages of what is refused with tensor parallel parameters (each before any collective)."""
    from fullshard.algorithms.full_load import load_full_state_dict

    messages = []
    torch.manual_seed(0)
    model = SPEC.model()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _parallelize(model, "gpt", mesh["tp"])
    with pytest.raises(ValueError) as refused:
        FullyShardedDataParallel(model, device_mesh=mesh["dp"], use_orig_params=True)
    messages.append(str(refused.value))
    model = _build("gpt", "ours")
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = dict(model.state_dict())
    with pytest.raises(ValueError) as refused:
        load_full_state_dict(model, full if rank == 0 else None)
    messages.append(str(refused.value))
    return messages


def test_refusals_name_the_way_out(pool4: WorkerPool) -> None:
    for wrapper, full_load in pool4.run(refusals):
        assert "parameter 'blocks.0.fc.weight' is a DTensor" in wrapper
        assert "combine tensor parallelism with fully_shard: fully_shard(block, mesh=mesh['dp'])" in wrapper
        assert "are tensor parallel" in full_load and "model.load_state_dict(full)" in full_load

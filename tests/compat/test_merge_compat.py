"""Interop with the peers: checkpoints written by torch's FSDP (through Accelerate's layout and Accelerate's own
save helpers) merge with our merge_fsdp_weights exactly as with Accelerate's, and DCP folders load both ways."""

from __future__ import annotations

import os
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from fullshard.checkpoint.dcp import load_sharded, save_sharded
from fullshard.checkpoint.merge import merge_fsdp_weights
from fullshard.testing import WorkerPool, run_on_ranks


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3, bias=False))


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


def _torch_fsdp2_save(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    """torch FSDP2 + one Adam step, saved the way Accelerate does: dcp.save({"model": model.state_dict()})."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(_model(0))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    optim.step()
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(f"{root}/pytorch_model_fsdp_0"))
    optim_sd = get_optimizer_state_dict(model, optim)
    dcp.save({"optimizer": optim_sd}, storage_writer=dcp.FileSystemWriter(f"{root}/optimizer_0"))
    return _full(model)


def _accelerate_merge(checkpoint_dir: Path, output: Path, safe: bool) -> dict[str, torch.Tensor]:
    accelerate_utils = pytest.importorskip("accelerate.utils")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerate_utils.merge_fsdp_weights(str(checkpoint_dir), str(output), safe_serialization=safe)
    return load_file(output / "model.safetensors") if safe else torch.load(output / "pytorch_model.bin")


def _ours(checkpoint_dir: Path, output: Path, safe: bool) -> dict[str, torch.Tensor]:
    files = merge_fsdp_weights(checkpoint_dir, output, safe_serialization=safe)
    return load_file(files[0]) if safe else torch.load(files[0], weights_only=True)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("safe", [True, False])
def test_torch_fsdp2_checkpoint_merges_like_accelerate(pool2: WorkerPool, tmp_path: Path, safe: bool) -> None:
    full = pool2.run(_torch_fsdp2_save, str(tmp_path))[0]
    ours = _ours(tmp_path / "pytorch_model_fsdp_0", tmp_path / "ours", safe)
    _assert_same(ours, full)
    _assert_same(ours, _accelerate_merge(tmp_path / "pytorch_model_fsdp_0", tmp_path / "theirs", safe))


def test_torch_fsdp2_optimizer_merges_like_accelerate(pool2: WorkerPool, tmp_path: Path) -> None:
    pool2.run(_torch_fsdp2_save, str(tmp_path))
    ours = torch.load(merge_fsdp_weights(tmp_path / "optimizer_0", tmp_path / "o", False)[0], weights_only=True)
    theirs = _accelerate_merge(tmp_path / "optimizer_0", tmp_path / "t", safe=False)
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for name, state in theirs["state"].items():
        _assert_same(ours["state"][name], state)


def _accelerate_helpers_save(rank: int, world: int, root: str) -> list[dict[str, torch.Tensor]]:
    """Accelerate's own save_fsdp_model, FSDP1 and FSDP2, on CPU (the accelerator is a stub: the helper reads
    only process_index / num_processes from it)."""
    from accelerate import FullyShardedDataParallelPlugin, PartialState
    from accelerate.utils import save_fsdp_model
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    PartialState(cpu=True)
    accelerator = types.SimpleNamespace(process_index=rank, num_processes=world)
    fulls = []
    for version in (1, 2):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type="SHARDED_STATE_DICT")
        if version == 1:
            model = FullyShardedDataParallel(_model(version), device_id=torch.device("cpu"), use_orig_params=True)
        else:
            model = fully_shard(_model(version))
        save_fsdp_model(plugin, accelerator, model, f"{root}/fsdp{version}")
        if version == 2:
            fulls.append(_full(model))
        else:
            fulls.append({k: v.clone() for k, v in _model(version).state_dict().items()})
    return fulls


def test_accelerate_save_helpers_fsdp1_and_fsdp2(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    fulls = run_on_ranks(_accelerate_helpers_save, 2, str(tmp_path))[0]
    for version, full in zip((1, 2), fulls, strict=True):
        folder = tmp_path / f"fsdp{version}" / "pytorch_model_fsdp_0"
        ours = _ours(folder, tmp_path / f"ours{version}", True)
        _assert_same(ours, full)
        _assert_same(ours, _accelerate_merge(folder, tmp_path / f"theirs{version}", True))


def _interop_both_ways(rank: int, world: int, root: str) -> list[bool]:
    from torch.distributed.fsdp import fully_shard

    source = fully_shard(_model(3))
    expected = _full(source)
    # - fullshard writes, torch's FSDP2 reads with plain dcp.load
    save_sharded({"model": source.state_dict()}, f"{root}/ours")
    target = fully_shard(_model(4))
    state = {"model": target.state_dict()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(f"{root}/ours"))
    target.load_state_dict(state["model"])
    torch_reads_ours = all(torch.equal(v, expected[k]) for k, v in _full(target).items())
    # - torch writes, fullshard's load_sharded reads into the FSDP2 model's DTensors
    dcp.save({"model": source.state_dict()}, storage_writer=dcp.FileSystemWriter(f"{root}/theirs"))
    target = fully_shard(_model(5))
    state = {"model": target.state_dict()}
    load_sharded(state, f"{root}/theirs")
    target.load_state_dict(state["model"])
    ours_reads_torch = all(torch.equal(v, expected[k]) for k, v in _full(target).items())
    return [torch_reads_ours, ours_reads_torch]


def test_dcp_folders_load_both_ways(pool2: WorkerPool, tmp_path: Path) -> None:
    assert pool2.run(_interop_both_ways, str(tmp_path)) == [[True, True], [True, True]]

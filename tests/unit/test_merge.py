"""merge_fsdp_weights on 2-rank DCP checkpoints: bitwise output, layouts, and every refusal it makes."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fullshard.checkpoint.merge import merge_fsdp_weights
from fullshard.testing import WorkerPool


def _full_model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(11, 4, generator=g),
        "blocks.0.attn.weight": torch.randn(6, 6, generator=g).to(torch.bfloat16),
        "blocks.0.attn.bias": torch.randn(6, generator=g).to(torch.float16),
        "blocks.1.mlp.weight": torch.randn(9, 3, generator=g),
        "norm.eps_count": torch.tensor([3], dtype=torch.int64),
    }


def _write_accelerate_style(rank: int, world: int, root: str) -> None:
    """What Accelerate's save_fsdp_model does with FSDP2: dcp.save({"model": sharded_sd}) into pytorch_model_fsdp_0."""
    mesh = init_device_mesh("cpu", (world,))
    model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _full_model().items()}
    dcp.save({"model": model}, storage_writer=dcp.FileSystemWriter(f"{root}/pytorch_model_fsdp_0"))
    floats = {k: v for k, v in _full_model().items() if v.is_floating_point()}
    exp_avg = {k: distribute_tensor(v * 0.5, mesh, [Shard(0)]) for k, v in floats.items()}
    optim = {
        "state": {k: {"exp_avg": v, "step": torch.tensor(4.0)} for k, v in exp_avg.items()},
        "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": sorted(exp_avg)}],
    }
    dcp.save({"optimizer": optim}, storage_writer=dcp.FileSystemWriter(f"{root}/optimizer_0"))


@pytest.fixture(scope="module")
def ckpt_root(pool2: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("accelerate_ckpt")
    pool2.run(_write_accelerate_style, str(root))
    return root


@pytest.fixture
def model_dir(ckpt_root: Path, tmp_path: Path) -> Path:
    """A private copy of the model folder, for tests that damage or delete it."""
    return Path(shutil.copytree(ckpt_root / "pytorch_model_fsdp_0", tmp_path / "ckpt" / "pytorch_model_fsdp_0"))


def _assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8))


def test_merge_to_safetensors_is_bitwise_equal(ckpt_root: Path, tmp_path: Path) -> None:
    files = merge_fsdp_weights(ckpt_root / "pytorch_model_fsdp_0", tmp_path)
    assert files == [tmp_path / "model.safetensors"]
    _assert_bitwise_equal(load_file(files[0]), _full_model())  # the "model." top level is dropped


def test_merge_to_pytorch_model_bin(ckpt_root: Path, tmp_path: Path) -> None:
    files = merge_fsdp_weights(str(ckpt_root / "pytorch_model_fsdp_0"), str(tmp_path), safe_serialization=False)
    assert files == [tmp_path / "pytorch_model.bin"]
    _assert_bitwise_equal(torch.load(files[0], weights_only=True), _full_model())


def test_merge_sharded_output_loads_through_the_index(ckpt_root: Path, tmp_path: Path) -> None:
    files = merge_fsdp_weights(ckpt_root / "pytorch_model_fsdp_0", tmp_path, max_shard_size="100B")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert files[-1] == tmp_path / "model.safetensors.index.json"
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in _full_model().values())
    merged = {name: load_file(tmp_path / file)[name] for name, file in index["weight_map"].items()}
    _assert_bitwise_equal(merged, _full_model())


def test_merge_optimizer_folder(ckpt_root: Path, tmp_path: Path) -> None:
    # - .bin: the nested optimizer state dict, as Accelerate's merge writes it
    files = merge_fsdp_weights(ckpt_root / "optimizer_0", tmp_path / "bin", safe_serialization=False)
    optim = torch.load(files[0], weights_only=True)
    floats = {k: v for k, v in _full_model().items() if v.is_floating_point()}
    assert optim["param_groups"] == [{"lr": 0.01, "betas": (0.9, 0.95), "params": sorted(floats)}]
    _assert_bitwise_equal({k: s["exp_avg"] for k, s in optim["state"].items()}, {k: v * 0.5 for k, v in floats.items()})
    # - safetensors: tensors under dotted names, the rest as JSON metadata
    files = merge_fsdp_weights(ckpt_root / "optimizer_0", tmp_path / "st")
    loaded = load_file(files[0])
    assert torch.equal(loaded["state.embed.weight.exp_avg"], floats["embed.weight"] * 0.5)
    with safe_open(files[0], "pt") as f:
        extra = json.loads(f.metadata()["non_tensor_state"])
    assert extra["param_groups.0.lr"] == 0.01
    with pytest.raises(ValueError, match=re.escape("holds a nested state (e.g. an optimizer)")):
        merge_fsdp_weights(ckpt_root / "optimizer_0", tmp_path / "x", safe_serialization=False, max_shard_size="1MB")


def test_parent_folder_names_the_subfolder(ckpt_root: Path, tmp_path: Path) -> None:
    expected = (
        f"merge_fsdp_weights(checkpoint_dir='{ckpt_root}'): this folder holds no .metadata; it is the parent of "
        f"sharded checkpoint folder(s). Pass the subfolder instead: '{ckpt_root / 'pytorch_model_fsdp_0'}' or "
        f"'{ckpt_root / 'optimizer_0'}'."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        merge_fsdp_weights(ckpt_root, tmp_path)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(f"merge_fsdp_weights(checkpoint_dir='{tmp_path / 'no'}')")):
        merge_fsdp_weights(tmp_path / "no", tmp_path / "out")


def test_missing_shard_file_is_named(model_dir: Path, tmp_path: Path) -> None:
    (model_dir / "__1_0.distcp").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{model_dir / '__1_0.distcp'} is missing")):
        merge_fsdp_weights(model_dir, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_truncated_shard_file_is_named(model_dir: Path, tmp_path: Path) -> None:
    shard = model_dir / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(RuntimeError, match=re.escape(f"{shard} is truncated")):
        merge_fsdp_weights(model_dir, tmp_path / "out")


def test_corrupt_shard_file_is_named(model_dir: Path, tmp_path: Path) -> None:
    shard = model_dir / "__1_0.distcp"
    shard.write_bytes(b"\x00" * shard.stat().st_size)  # right size, garbage content
    with pytest.raises(RuntimeError, match=re.escape(f"{shard} is damaged: the stored bytes of ")):
        merge_fsdp_weights(model_dir, tmp_path / "out")
    # nothing half-written is left where a loader would pick it up
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_corrupt_metadata_is_named(model_dir: Path, tmp_path: Path) -> None:
    (model_dir / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(RuntimeError, match=re.escape(f"{model_dir / '.metadata'} is corrupt")):
        merge_fsdp_weights(model_dir, tmp_path / "out")


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (shutil.rmtree, ("/definitely/not/here",))


def test_metadata_is_not_unpickled_as_arbitrary_objects(model_dir: Path, tmp_path: Path) -> None:
    (model_dir / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(RuntimeError, match=re.escape("shutil.rmtree is not allowed in a checkpoint's .metadata")):
        merge_fsdp_weights(model_dir, tmp_path / "out")


def test_remove_checkpoint_dir_after_verified_output(model_dir: Path, tmp_path: Path) -> None:
    files = merge_fsdp_weights(model_dir, tmp_path / "out", remove_checkpoint_dir=True, max_shard_size=200)
    assert not model_dir.exists()
    merged = {}
    for file in files[:-1]:
        merged |= load_file(file)
    _assert_bitwise_equal(merged, _full_model())


def test_remove_checkpoint_dir_keeps_folder_when_merge_fails(model_dir: Path, tmp_path: Path) -> None:
    (model_dir / "__1_0.distcp").write_bytes(b"\x00" * (model_dir / "__1_0.distcp").stat().st_size)
    with pytest.raises(RuntimeError):
        merge_fsdp_weights(model_dir, tmp_path / "out", remove_checkpoint_dir=True)
    assert (model_dir / "__0_0.distcp").is_file()


def test_output_inside_checkpoint_is_refused(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("the output would land inside the sharded checkpoint folder that")):
        merge_fsdp_weights(model_dir, model_dir / "merged", remove_checkpoint_dir=True)


def test_progress_bar_runs(ckpt_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    merge_fsdp_weights(ckpt_root / "pytorch_model_fsdp_0", tmp_path, show_progress=True)
    assert "merging pytorch_model_fsdp_0" in capsys.readouterr().err

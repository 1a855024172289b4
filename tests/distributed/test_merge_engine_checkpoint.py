"""merge_fsdp_weights and ``fullshard merge-weights`` on checkpoints the engine wrote, both entry points.

Set up: TinyGPT with tied weights plus buffers (float, bf16 and int64; one non-persistent), one AdamW step
on 2 gloo ranks under ``fully_shard`` or the wrapper; ``save_sharded({"model": sharded state dict})`` into
``pytorch_model_fsdp_0/``, and rank 0's FULL state dict.
Run: the library merge (safetensors and ``pytorch_model.bin``), and the CLI in a subprocess.
Check: every output holds bitwise the FULL state dict: same keys (both names of the tied weight, no
non-persistent buffer), dtypes and values.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fullshard import FSDP, FullStateDictConfig, StateDictType
from fullshard.checkpoint import load_sharded, merge_fsdp_weights, model_folder_name, save_sharded
from fullshard.testing import WorkerPool
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch
from tests.distributed.test_checkpoint_reshard import shard

SRC = Path(__file__).resolve().parents[2] / "src"
CFG = GPTConfig(tie_weights=True)


class BufferedGPT(TinyGPT):
    """TinyGPT with buffers of three dtypes, at the root and inside a block, and one non-persistent."""

    def __init__(self) -> None:
        super().__init__(CFG)
        self.register_buffer("seen", torch.arange(5, dtype=torch.int64))
        self.register_buffer("scratch", torch.ones(2), persistent=False)
        self.blocks[0].register_buffer("gain", torch.linspace(0.5, 1.5, 7))
        self.blocks[1].register_buffer("mask", torch.linspace(-1, 1, 9).to(torch.bfloat16))


def save_for_merge(rank: int, world: int, layout: str, root: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = shard(BufferedGPT(), layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = make_batch(CFG, 4, seed=rank)
    model(x, y).backward()
    opt.step()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        save_sharded({"model": model.state_dict()}, Path(root) / model_folder_name(0))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.parametrize("layout", ["fully_shard", "FULL_SHARD"])
def test_merge_equals_the_full_state_dict(pool2: WorkerPool, tmp_path: Path, layout: str) -> None:
    # - Set up
    full = pool2.run(save_for_merge, layout, str(tmp_path))[0]
    assert {"wte.weight", "head.weight", "seen", "blocks.0.gain", "blocks.1.mask"} <= set(full)
    assert "scratch" not in full
    folder = tmp_path / model_folder_name(0)
    # - Run / Check: the library merge, both formats
    (safe,) = merge_fsdp_weights(folder, tmp_path / "safe")
    assert safe.name == "model.safetensors"
    _assert_bitwise(load_file(safe), full)
    (pickled,) = merge_fsdp_weights(folder, tmp_path / "bin", safe_serialization=False)
    assert pickled.name == "pytorch_model.bin"
    _assert_bitwise(torch.load(pickled, weights_only=True), full)
    # - and the merged file loads back into a plain model (strict)
    model = BufferedGPT()
    model.load_state_dict(load_file(safe))
    _assert_bitwise(model.state_dict(), full)


def test_merge_weights_cli_end_to_end(pool2: WorkerPool, tmp_path: Path) -> None:
    # - Set up: a fully_shard checkpoint; the CLI runs in a child process on this worktree's code
    full = pool2.run(save_for_merge, "fully_shard", str(tmp_path))[0]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "fullshard.cli.main", "merge-weights", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)

    # - Run / Check: the parent folder is refused with the subfolder to pass; the subfolder merges bitwise
    wrong = cli(str(tmp_path), str(tmp_path / "out"))
    assert wrong.returncode != 0 and str(tmp_path / model_folder_name(0)) in wrong.stderr
    done = cli(str(tmp_path / model_folder_name(0)), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    _assert_bitwise(load_file(tmp_path / "out" / "model.safetensors"), full)
    # - and the sharded folder still loads after merging (the merge only reads it)
    target = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
    load_sharded(target, tmp_path / model_folder_name(0))
    _assert_bitwise(target["model"], full)

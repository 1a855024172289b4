"""save_sharded / load_sharded: DTensor state dicts, resharding (2 -> 1, 2 -> 4, 1-D <-> 2-D), atomicity, errors."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fullshard.checkpoint.writer as writer_mod
from fullshard.checkpoint import dcp as ckpt
from fullshard.checkpoint.merge import merge_fsdp_weights
from fullshard.checkpoint.names import STAGING_TAG
from fullshard.checkpoint.reader import COMPLETE_MARKER
from fullshard.testing import WorkerPool


def _full_state(seed: int) -> dict[str, torch.Tensor]:
    """Deterministic full tensors; odd row counts make the shards uneven."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(7, 4, generator=g),
        "layer.weight": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "layer.bias": torch.randn(5, generator=g),
        "counter": torch.arange(3, dtype=torch.int64) + seed,
    }


def _sharded(full: dict[str, torch.Tensor], mesh_shape: tuple[int, ...]) -> dict[str, DTensor]:
    if len(mesh_shape) == 1:
        mesh, placements = init_device_mesh("cpu", mesh_shape), [Shard(0)]
    else:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        placements = [Replicate(), Shard(0)]
    return {k: distribute_tensor(v, mesh, placements) for k, v in full.items()}


def _empty_like(full: dict[str, torch.Tensor], mesh_shape: tuple[int, ...]) -> dict[str, DTensor]:
    return _sharded({k: torch.zeros_like(v) for k, v in full.items()}, mesh_shape)


def _save(rank: int, world: int, path: str, seed: int, mesh_shape: tuple[int, ...]) -> None:
    ckpt.save_sharded({"model": _sharded(_full_state(seed), mesh_shape)}, path)


def _load_and_compare(rank: int, world: int, path: str, seed: int, mesh_shape: tuple[int, ...]) -> bool:
    target = {"model": _empty_like(_full_state(seed), mesh_shape)}
    ckpt.load_sharded(target, path)
    expected = _full_state(seed)
    return all(torch.equal(target["model"][k].full_tensor(), expected[k]) for k in expected)


def _load_single_process(path: Path, seed: int) -> bool:
    target = {"model": {k: torch.zeros_like(v) for k, v in _full_state(seed).items()}}
    ckpt.load_sharded(target, path)
    return all(torch.equal(target["model"][k], v) for k, v in _full_state(seed).items())


def test_save_2_load_4_and_1(pool2: WorkerPool, pool4: WorkerPool, tmp_path: Path) -> None:
    # - Set up / Run: save with 2 ranks (1-D mesh)
    path = tmp_path / "pytorch_model_fsdp_0"
    pool2.run(_save, str(path), 0, (2,))
    # - Check: a plain DCP folder with one data file per rank and our marker
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [".metadata", "__0_0.distcp", "__1_0.distcp", COMPLETE_MARKER]
    )
    assert pool4.run(_load_and_compare, str(path), 0, (4,)) == [True] * 4
    assert pool2.run(_load_and_compare, str(path), 0, (2,)) == [True] * 2
    assert _load_single_process(path, 0)


def test_hybrid_2x2_mesh_round_trip(pool2: WorkerPool, pool4: WorkerPool, tmp_path: Path) -> None:
    path = tmp_path / "hsdp"
    pool4.run(_save, str(path), 1, (2, 2))
    assert pool4.run(_load_and_compare, str(path), 1, (2, 2)) == [True] * 4
    assert pool2.run(_load_and_compare, str(path), 1, (2,)) == [True] * 2
    # and the other way: 1-D save, 2-D load
    path_1d = tmp_path / "fsdp"
    pool2.run(_save, str(path_1d), 2, (2,))
    assert pool4.run(_load_and_compare, str(path_1d), 2, (2, 2)) == [True] * 4


def test_merge_reads_our_checkpoint(pool2: WorkerPool, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = tmp_path / "pytorch_model_fsdp_0"
    pool2.run(_save, str(path), 3, (2,))
    merged = load_file(merge_fsdp_weights(path, tmp_path / "out")[0])
    expected = _full_state(3)
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[k], v) for k, v in expected.items())


def _failing_save(rank: int, world: int, path: str) -> str:
    """Rank 1 fails after its shards are on disk, before the rename; every rank must raise."""
    original = writer_mod._verify_own_files

    def fail(staging: Path, r: int) -> None:
        original(staging, r)
        if r == 1:
            raise OSError("simulated crash of rank 1 after writing its shards")

    writer_mod._verify_own_files = fail
    try:
        ckpt.save_sharded({"model": _sharded(_full_state(9), (2,))}, path)
    except RuntimeError as exc:
        return str(exc)
    finally:
        writer_mod._verify_own_files = original
    return "no error"


def test_atomic_save_keeps_previous_checkpoint(pool2: WorkerPool, tmp_path: Path) -> None:
    # - Set up: a good checkpoint (seed 4)
    path = tmp_path / "pytorch_model_fsdp_0"
    pool2.run(_save, str(path), 4, (2,))
    # - Run: a second save where rank 1 fails mid-save
    messages = pool2.run(_failing_save, str(path))
    # - Check: every rank raised, naming the failing rank; the old checkpoint is intact; the partial save was
    #   removed (one commit protocol: transaction.py), and a staging folder a killed save leaves is refused
    assert all("writing shards failed on rank(s) [1]" in m for m in messages), messages
    assert "simulated crash of rank 1" in messages[1]
    assert all("The partial save was removed." in m for m in messages), messages
    assert _load_single_process(path, 4)
    staging = tmp_path / "pytorch_model_fsdp_0.incomplete"
    assert not staging.exists()
    shutil.copytree(path, staging)  # what a save killed before its commit leaves: the shards, no marker,
    (staging / COMPLETE_MARKER).unlink()  # and the tag of its owner, a process that is gone
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    tag = {"host": socket.gethostname(), "pid": gone.pid, "save_id": "killed"}
    (staging / STAGING_TAG).write_text(json.dumps(tag))
    target = {"model": {k: torch.zeros_like(v) for k, v in _full_state(9).items()}}
    with pytest.raises(RuntimeError, match=re.escape("the checkpoint is incomplete")):
        ckpt.load_sharded(target, staging)
    with pytest.raises(RuntimeError, match=re.escape("the checkpoint is incomplete")):
        merge_fsdp_weights(staging, tmp_path / "out")
    # - Run / Check: the next good save replaces the old one and clears the staging folder
    pool2.run(_save, str(path), 5, (2,))
    assert _load_single_process(path, 5)
    assert not staging.exists() and not (tmp_path / "pytorch_model_fsdp_0.previous").exists()


def _load_expecting_error(rank: int, world: int, path: str, target: dict[str, Any]) -> str:
    try:
        ckpt.load_sharded(target, path)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return "no error"


def test_mismatched_keys_and_shapes_are_named(pool2: WorkerPool, tmp_path: Path) -> None:
    path = tmp_path / "ck"
    pool2.run(_save, str(path), 6, (2,))
    target = {"model": {k: torch.zeros_like(v) for k, v in _full_state(6).items()}}
    target["model"]["layer.bias"] = torch.zeros(6)
    target["model"]["extra.weight"] = torch.zeros(2)
    del target["model"]["counter"]
    messages = pool2.run(_load_expecting_error, str(path), target)
    for message in messages:
        assert "Missing from the checkpoint: ['model.extra.weight']" in message
        assert "In the checkpoint but not the target: ['model.counter']" in message
        assert "model.layer.bias: checkpoint (5,), target (6,)" in message
    # strict=False ignores the extra checkpoint key but not the rest
    with pytest.raises(ValueError, match=re.escape("In the checkpoint but not the target: []")):
        ckpt.load_sharded(target, path, strict=False)


def test_partial_folder_without_metadata_is_refused(pool2: WorkerPool, tmp_path: Path) -> None:
    path = tmp_path / "ck"
    pool2.run(_save, str(path), 7, (2,))
    partial = tmp_path / "partial"
    shutil.copytree(path, partial)
    (partial / ".metadata").unlink()
    target = {"model": {k: torch.zeros_like(v) for k, v in _full_state(7).items()}}
    with pytest.raises(
        RuntimeError, match=re.escape(f"load_sharded(checkpoint_dir='{partial}'): the checkpoint is incomplete")
    ):
        ckpt.load_sharded(target, partial)
    # a data file whose size differs from the marker's record is refused, naming the file
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    with open(damaged / "__1_0.distcp", "ab") as f:
        f.write(b"junk")
    with pytest.raises(RuntimeError, match=re.escape(f"{damaged / '__1_0.distcp'} is ")):
        ckpt.load_sharded(target, damaged)


def _optimizer_state(rank: int, world: int, path: str, save: bool) -> list[Any]:
    mesh = init_device_mesh("cpu", (world,))
    exp_avg = distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
    state: dict[str, Any] = {
        "optimizer": {
            "state": {"w": {"exp_avg": exp_avg, "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.5, "betas": (0.9, 0.99), "params": ["w"]}],
        }
    }
    if save:
        ckpt.save_sharded(state, path)
        return []
    state["optimizer"]["state"]["w"] = {"exp_avg": exp_avg * 0, "step": torch.tensor(0.0)}
    state["optimizer"]["param_groups"] = [{"lr": 0.0, "betas": (0.0, 0.0), "params": ["?"]}]
    ckpt.load_sharded(state, path)
    w = state["optimizer"]["state"]["w"]
    return [w["exp_avg"].full_tensor().tolist(), w["step"].item(), state["optimizer"]["param_groups"]]


def test_nested_optimizer_state_round_trip(pool2: WorkerPool, tmp_path: Path) -> None:
    path = str(tmp_path / "optimizer_0")
    pool2.run(_optimizer_state, path, True)
    results = pool2.run(_optimizer_state, path, False)
    expected = [[[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], 3.0, [{"lr": 0.5, "betas": (0.9, 0.99), "params": ["w"]}]]
    assert results == [expected, expected]


def test_single_process_without_process_group(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    ckpt.save_sharded({"model": _full_state(8)}, path)
    assert _load_single_process(path, 8)


def test_check_sharded_reads_nothing_into_the_target(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    ckpt.save_sharded({"model": _full_state(8)}, path)
    target = {"model": {k: torch.zeros_like(v) for k, v in _full_state(8).items()}}
    ckpt.check_sharded(target, path)
    assert all(not torch.count_nonzero(v) for v in target["model"].values()), "a check loads nothing"
    target["model"]["embed.weight"] = torch.zeros(8, 4)
    with pytest.raises(ValueError, match=re.escape("model.embed.weight: checkpoint (7, 4), target (8, 4)")):
        ckpt.check_sharded(target, path)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: ckpt.save_sharded([], p), "save_sharded(state=list): expected a non-empty dict"),
        (lambda p: ckpt.save_sharded({}, p), "save_sharded(state=an empty dict): expected a non-empty dict"),
        (lambda p: ckpt.save_sharded({"m": torch.nn.Linear(1, 1)}, p), "save_sharded: state['m'] is a Linear"),
        (lambda p: ckpt.save_sharded({"m": torch.zeros(1)}, 3), "save_sharded(checkpoint_dir=3): expected a folder"),
        (lambda p: ckpt.save_sharded({"m": torch.zeros(1)}, f"{p}/x.incomplete"), "names ending in '.incomplete'"),
        (lambda p: ckpt.load_sharded({"m": torch.zeros(1)}, f"{p}/nope"), "load_sharded(checkpoint_dir='"),
    ],
)
def test_argument_errors(tmp_path: Path, call: Any, message: str) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)):
        call(tmp_path)

"""Checkpoint file and folder names match Accelerate's (seed 001/002 layout)."""

from __future__ import annotations

import re

import pytest

from fullshard.checkpoint import names


def test_constants() -> None:
    assert (names.MODEL_NAME, names.OPTIMIZER_NAME) == ("pytorch_model", "optimizer")
    assert names.RNG_STATE_NAME == "random_states"
    assert (names.SCALER_NAME, names.SCHEDULER_NAME) == ("scaler.pt", "scheduler")
    assert (names.WEIGHTS_NAME, names.WEIGHTS_INDEX_NAME) == ("pytorch_model.bin", "pytorch_model.bin.index.json")
    assert (names.SAFE_WEIGHTS_NAME, names.SAFE_WEIGHTS_INDEX_NAME) == (
        "model.safetensors",
        "model.safetensors.index.json",
    )


def test_indexed_names() -> None:
    assert names.model_folder_name(0) == "pytorch_model_fsdp_0"
    assert names.optimizer_folder_name(1) == "optimizer_1"
    assert (names.scheduler_file_name(0), names.scheduler_file_name(2)) == ("scheduler.bin", "scheduler_2.bin")
    assert (names.optimizer_file_name(0), names.sampler_file_name(1)) == ("optimizer.bin", "sampler_1.bin")
    assert names.rng_state_file_name(0) == "random_states_0.pkl"
    assert names.step_in_progress_file_name(1) == "step_in_progress_1.pt"
    assert names.is_load_state_part("step_in_progress_1.pt")  # a stale one from another save is caught by verify
    assert names.dcp_shard_file_name(3) == "__3_0.distcp"
    assert names.custom_checkpoint_file_name(0) == "custom_checkpoint_0.pkl"
    assert names.weights_shard_file_name(2, 12) == "model-00002-of-00012.safetensors"
    assert names.weights_shard_file_name(1, 3, safe_serialization=False) == "pytorch_model-00001-of-00003.bin"


def test_bad_indices() -> None:
    with pytest.raises(ValueError, match=re.escape("index=-1: expected a non-negative int")):
        names.model_folder_name(-1)
    with pytest.raises(ValueError, match=re.escape("rank='0': expected a non-negative int")):
        names.rng_state_file_name("0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("shard=0, num_shards=2: expected 1 <= shard <= num_shards")):
        names.weights_shard_file_name(0, 2)

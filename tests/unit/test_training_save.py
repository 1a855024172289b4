"""A training folder saved in one call (``checkpoint.save_folder``): what the caller says goes into it (a sharded
part, a part written whole, each rank's small files, a hook's own file) is in the committed folder and recorded in
its manifest; a write that fails anywhere leaves nothing behind and names the step. One rank, in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fullshard.checkpoint import (
    Part,
    TrainingFolder,
    is_complete_checkpoint,
    load_sharded,
    read_manifest,
    save_folder,
    verify_checkpoint,
)


def _folder(small: dict[str, Any]) -> TrainingFolder:
    def hook(staging: Path) -> None:
        (staging / "hook.txt").write_text("written by a pre-save hook")

    return TrainingFolder(
        parts=[
            Part("pytorch_model_fsdp_0", True, lambda: {"model": {"w": torch.arange(6.0).reshape(2, 3)}}),
            Part("optimizer.bin", False, lambda: {"state": {0: {"step": torch.tensor(4.0)}}}),
        ],
        small_files=lambda rank: {**small, f"random_states_{rank}.pkl": {"seed": 7}},
        small_files_are="the small things",
        before=hook,
    )


def test_save_folder_writes_what_the_caller_says_in_one_call(tmp_path: Path) -> None:
    # - Run
    target = save_folder(tmp_path / "ck", "test", _folder({"scheduler.bin": {"last_epoch": 2}}))
    # - Check: committed whole, every file recorded and intact, and each part reads back as written
    assert target == tmp_path / "ck" and is_complete_checkpoint(target)
    recorded = set(read_manifest(target).files)
    assert {"optimizer.bin", "scheduler.bin", "random_states_0.pkl", "hook.txt"} <= recorded
    assert any(name.startswith("pytorch_model_fsdp_0/") for name in recorded)
    verify_checkpoint(target)
    state = {"model": {"w": torch.zeros(2, 3)}}
    load_sharded(state, target / "pytorch_model_fsdp_0")
    assert torch.equal(state["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert torch.load(target / "optimizer.bin")["state"][0]["step"].item() == 4.0
    assert (target / "hook.txt").read_text() == "written by a pre-save hook"


def test_save_folder_that_fails_leaves_nothing_and_names_the_step(tmp_path: Path) -> None:
    # - Run: a small file that cannot be pickled
    with pytest.raises(RuntimeError, match="writing the small things") as failure:
        save_folder(tmp_path / "ck", "test", _folder({"scheduler.bin": lambda: None}))
    # - Check: no folder, no staging folder, and the error says where
    assert "test" in str(failure.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []

"""ProjectConfiguration(automatic_checkpoint_naming=True): checkpoint_<i> names, total_limit, the latest complete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import fullshard
from fullshard import Accelerator
from fullshard.testing import WorkerPool
from fullshard.utils import ProjectConfiguration, latest_checkpoint
from tests.distributed.test_accelerator import PER_RANK, dataset, model_and_optimizer, plugin


def _accelerator(root: str, **config: Any) -> Accelerator:
    project = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True, **config)
    return Accelerator(fsdp_plugin=plugin(2), project_config=project)


def _step(accelerator: Accelerator, model: Any, optimizer: Any, scheduler: Any, i: int) -> None:
    x, y = dataset()[i * PER_RANK : (i + 1) * PER_RANK]
    accelerator.backward(model(x, y))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def save_three_then_resume(rank: int, world: int, root: str) -> Any:
    accelerator = _accelerator(root, total_limit=2)
    hooked: list[str] = []  # the folders the pre-save / pre-load hooks are given
    accelerator.register_save_state_pre_hook(lambda models, weights, out: hooked.append(Path(out).name))
    model, optimizer, scheduler = accelerator.prepare(*model_and_optimizer(seed=0))
    snapshots, returned = [], []
    for i in range(3):
        _step(accelerator, model, optimizer, scheduler, i)
        returned.append(Path(accelerator.save_state()).name)
        snapshots.append(accelerator.get_state_dict(model))
    names = sorted(p.name for p in (Path(root) / "checkpoints").iterdir())
    # - a fresh run (another seed) resumes from the latest complete checkpoint without naming it
    resumed = _accelerator(root, total_limit=2)
    resumed.register_load_state_pre_hook(lambda models, folder: hooked.append(Path(folder).name))
    model2, _, _ = resumed.prepare(*model_and_optimizer(seed=1))
    resumed.load_state()
    same = all(torch.equal(v, snapshots[2][k]) for k, v in resumed.get_state_dict(model2).items())
    # hooks see the folder chosen by automatic naming: its staging folder while saving, the folder when loading
    assert hooked == [*(f"{name}.incomplete" for name in returned), "checkpoint_2"], hooked
    return returned, names, same, resumed.save_iteration


def test_automatic_naming_keeps_total_limit_and_resumes_from_the_latest(pool2: WorkerPool, tmp_path: Path) -> None:
    # - Run: 3 saves with total_limit=2 on 2 ranks, then load_state() with no folder in a fresh Accelerator
    returned, names, same, iteration = pool2.run(save_three_then_resume, str(tmp_path))[0]
    # - Check: Accelerate's names; the oldest was deleted; the latest loaded bitwise; the next save is number 3
    assert returned == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert names == ["checkpoint_1", "checkpoint_2"]
    assert same and iteration == 3
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "checkpoint_2"
    assert latest_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "checkpoint_2"
    # - a partial newer folder (no random states, no manifest) and a staging folder are never the latest
    partial = shutil.copytree(tmp_path / "checkpoints" / "checkpoint_2", tmp_path / "checkpoints" / "checkpoint_3")
    (Path(partial) / "random_states_0.pkl").unlink()
    (Path(partial) / ".fullshard_checkpoint.json").unlink(missing_ok=True)
    shutil.copytree(tmp_path / "checkpoints" / "checkpoint_2", tmp_path / "checkpoints" / "checkpoint_4.incomplete")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "checkpoint_2"


def save_with_a_hook_then_load(rank: int, world: int, folder: str) -> Any:
    accelerator = Accelerator(fsdp_plugin=plugin(2))
    accelerator.prepare(*model_and_optimizer(seed=0))
    accelerator.save_state(folder)  # an older checkpoint, without the hook's file, is replaced below
    version = {"n": 0}

    def save_config(models: Any, weights: Any, out: str) -> None:
        version["n"] += 1
        (Path(out) / "data.json").write_text(json.dumps({"version": version["n"]}))

    loaded: list[Any] = []
    accelerator.register_save_state_pre_hook(save_config)
    accelerator.register_load_state_pre_hook(
        lambda models, into: loaded.append(json.loads((Path(into) / "data.json").read_text()))
    )
    accelerator.save_state(folder)
    accelerator.save_state(folder, async_save=True)
    accelerator.wait_for_everyone()
    accelerator.load_state(folder, verify=True)
    listed = json.loads((Path(folder) / ".fullshard_checkpoint.json").read_text())["files"]
    return loaded, "data.json" in listed, sorted(p.name for p in Path(folder).parent.iterdir())


def test_pre_save_hook_files_are_committed_with_the_checkpoint(pool2: WorkerPool, tmp_path: Path) -> None:
    # - Run: a save_state pre-hook writes data.json into the folder it is given (as Accelerate's tests do), over
    #   an existing checkpoint, synchronously then in the background; a load hook reads it back
    folder = tmp_path / "ck"
    for loaded, listed, beside in pool2.run(save_with_a_hook_then_load, str(folder)):
        # - Check: the file is in the committed folder (the last save's), recorded in the manifest (verify
        #   checks it), and no staging or previous folder is left beside it
        assert loaded == [{"version": 2}]
        assert listed
        assert beside == ["ck"]


def load_with_nothing_saved(rank: int, world: int, root: str) -> str:
    accelerator = _accelerator(root)
    accelerator.prepare(*model_and_optimizer(seed=0))
    try:
        accelerator.load_state()
    except FileNotFoundError as exc:
        return str(exc)
    return "loaded"


def test_no_checkpoint_yet(pool2: WorkerPool, tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    for message in pool2.run(load_with_nothing_saved, str(tmp_path)):
        assert message.startswith(f"Accelerator.load_state(): no complete checkpoint under '{tmp_path}/checkpoints'")
        assert "fullshard.utils.latest_checkpoint(project_dir)" in message


def test_project_configuration_fields_and_checks() -> None:
    assert fullshard.ProjectConfiguration is ProjectConfiguration
    config = ProjectConfiguration(project_dir="p")
    assert (config.logging_dir, config.automatic_checkpoint_naming, config.total_limit, config.iteration) == (
        "p",
        False,
        None,
        0,
    )
    assert not config.save_on_each_node
    with pytest.raises(ValueError, match=r"ProjectConfiguration\(total_limit=0\): expected an int >= 1"):
        ProjectConfiguration(total_limit=0)

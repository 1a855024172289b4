"""save_state(..., async_save=True): the state is copied to host memory, then written and committed in the background.

Checks that the files are a synchronous save's, that training runs on while the write is held back and that the
next save or load waits for it, and that a failure in the background (a real full disk) is raised at the next
call that waits, naming the file, with the previous checkpoint intact. A kill mid-write is in
``tests/cli/test_faults_launch.py`` (a launched job).
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fullshard.checkpoint import background, transaction
from fullshard.checkpoint.errors import BackgroundSaveError
from fullshard.checkpoint.manifest import read_manifest
from fullshard.checkpoint.names import DCP_METADATA_FILE
from fullshard.checkpoint.reader import read_metadata
from fullshard.cli.main import cli
from fullshard.frontend.saving import state_io
from fullshard.testing import WorkerPool
from tests.distributed.test_accelerator import PER_RANK, dataset
from tests.distributed.test_checkpoint_faults import _same, _train, load_each


def _step(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, i: int) -> None:
    x, y = dataset()[i * PER_RANK : (i + 1) * PER_RANK]
    accelerator.backward(model(x, y))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


# --- the same checkpoint ---------------------------------------------------------------------------------------


def save_sync_then_async(rank: int, world: int, root: str, full: bool) -> Any:
    accelerator, model, _, scheduler = _train(2, full=full)
    accelerator.save_state(f"{root}/sync")
    returned = accelerator.save_state(f"{root}/async", async_save=True)
    state_io.wait_for_save()
    return returned, (accelerator.get_state_dict(model), scheduler.state_dict())


def _assert_same_files(sync: Path, done: Path, at_least: int) -> None:
    """Every data file holds the same bytes; each .metadata the same index (its save_id differs)."""
    listed = read_manifest(sync).files  # type: ignore[union-attr]
    assert listed.keys() == read_manifest(done).files.keys()  # type: ignore[union-attr]
    compared = 0
    for name in listed:
        if Path(name).name == DCP_METADATA_FILE:
            a, b = read_metadata(sync / Path(name).parent), read_metadata(done / Path(name).parent)
            assert a.state_dict_metadata == b.state_dict_metadata and a.storage_data == b.storage_data, name
        elif not Path(name).name.startswith("."):  # markers: they hold the save_id
            assert (sync / name).read_bytes() == (done / name).read_bytes(), name
            compared += 1
    assert compared >= at_least, listed.keys()


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full-state-dict"])
def test_an_async_save_writes_the_synchronous_save_s_files(pool2: WorkerPool, tmp_path: Path, full: bool) -> None:
    returned, state = pool2.run(save_sync_then_async, str(tmp_path), full)[0]
    sync, done = tmp_path / "sync", tmp_path / "async"
    assert returned == str(done)
    _assert_same_files(sync, done, 4 if full else 6)
    result = CliRunner().invoke(cli, ["verify", str(done)])
    assert result.exit_code == 0 and "OK" in result.output, result.output
    assert _same(pool2.run(load_each, [str(done)], False, full)[0][0], state)


# --- the host buffers are kept between async saves -------------------------------------------------------------


def _kept() -> dict[tuple[Any, ...], int]:
    return {key: t.untyped_storage().data_ptr() for key, t in background.buffers().tensors.items()}


def two_async_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    state_io.release_save_buffers()  # nothing kept from an earlier test in this worker
    accelerator, model, optimizer, scheduler = _train(1)
    accelerator.save_state(f"{root}/first", async_save=True)
    state_io.wait_for_save()
    first = _kept()
    _step(accelerator, model, optimizer, scheduler, 1)  # new values, in place: the same shapes
    accelerator.save_state(f"{root}/sync")
    accelerator.save_state(f"{root}/second", async_save=True)
    state_io.wait_for_save()
    second = _kept()
    kept_bytes = background.buffers().nbytes()
    state_io.release_save_buffers()
    return {"first": first, "second": second, "bytes": kept_bytes, "after_release": _kept()}


def test_a_second_async_save_reuses_the_host_buffers_and_writes_its_own_values(
    pool2: WorkerPool, tmp_path: Path
) -> None:
    out = pool2.run(two_async_saves, str(tmp_path))
    for rank in out:
        # - Check: the second save copied into the first save's host tensors (the same storages, every key)
        assert rank["first"] and rank["second"] == rank["first"]
        assert rank["bytes"] > 0 and rank["after_release"] == {}
    # - Check: those buffers hold the second save's values (the synchronous save's bytes at the same step) ...
    _assert_same_files(tmp_path / "sync", tmp_path / "second", 6)
    # - ... not the first's: its model and optimizer files differ
    listed = read_manifest(tmp_path / "first").files  # type: ignore[union-attr]
    data = [n for n in listed if n.endswith(".distcp")]
    assert data and all((tmp_path / "first" / n).read_bytes() != (tmp_path / "second" / n).read_bytes() for n in data)


# --- the default: ProjectConfiguration(async_save=True) ---------------------------------------------------------


def saves_by_default(rank: int, world: int, root: str) -> dict[str, Any]:
    """Host buffers are kept by async saves only: they tell which kind of save ran."""
    from fullshard import ProjectConfiguration

    state_io.release_save_buffers()
    accelerator, _, _, _ = _train(1)
    accelerator.project_configuration = ProjectConfiguration(async_save=True)
    accelerator.save_state(f"{root}/default")
    state_io.wait_for_save()
    by_default = bool(_kept())
    state_io.release_save_buffers()
    accelerator.save_state(f"{root}/explicit", async_save=False)
    explicit = bool(_kept())
    return {"default": by_default, "explicit": explicit}


def test_project_configuration_makes_saves_async_by_default(pool2: WorkerPool, tmp_path: Path) -> None:
    for rank in pool2.run(saves_by_default, str(tmp_path)):
        assert rank == {"default": True, "explicit": False}
    _assert_same_files(tmp_path / "default", tmp_path / "explicit", 6)  # the same step, the same bytes


# --- training goes on, the next save and load wait -------------------------------------------------------------


def train_while_a_save_is_held(rank: int, world: int, root: str) -> dict[str, Any]:
    accelerator, model, optimizer, scheduler = _train(1)
    real_write, release = transaction.write_sharded, threading.Event()

    def held_write(*args: Any, **kwargs: Any) -> Any:  # the background write starts only once released
        if not release.wait(timeout=60):
            raise TimeoutError("never released")
        return real_write(*args, **kwargs)

    transaction.write_sharded = held_write
    out: dict[str, Any] = {}
    try:
        at_save = accelerator.get_state_dict(model), scheduler.state_dict()
        accelerator.save_state(f"{root}/first", async_save=True)  # returns while its write is held
        for i in range(1, 3):  # training (and its collectives) runs on meanwhile
            _step(accelerator, model, optimizer, scheduler, i)
        trained = accelerator.get_state_dict(model), scheduler.state_dict()
        out["during"] = background.pending(), Path(f"{root}/first").exists(), Path(f"{root}/first.incomplete").is_dir()
        threading.Timer(1.0, release.set).start()
        began = time.monotonic()
        accelerator.load_state(f"{root}/first")  # waits for the save, then loads what it wrote
        out["load_waited"] = time.monotonic() - began
        out["loaded_is_at_save"] = _same((accelerator.get_state_dict(model), scheduler.state_dict()), at_save)
        out["trained_differs"] = not _same(trained, at_save)
        # - The next save waits for a held one too
        release.clear()
        accelerator.save_state(f"{root}/second", async_save=True)
        threading.Timer(1.0, release.set).start()
        began = time.monotonic()
        accelerator.save_state(f"{root}/third")
        out["save_waited"] = time.monotonic() - began
    finally:
        transaction.write_sharded = real_write
        release.set()
        state_io.wait_for_save()
    return out


def test_training_runs_on_while_the_save_is_written_and_the_next_calls_wait(pool2: WorkerPool, tmp_path: Path) -> None:
    for out in pool2.run(train_while_a_save_is_held, str(tmp_path)):
        assert out["during"] == (True, False, True), "the save was pending, uncommitted, while training ran on"
        assert out["trained_differs"] and out["loaded_is_at_save"], out
        assert out["load_waited"] >= 0.9 and out["save_waited"] >= 0.9, out
    for name in ("first", "second", "third"):
        result = CliRunner().invoke(cli, ["verify", str(tmp_path / name)])
        assert result.exit_code == 0, result.output


# --- a failure in the background -------------------------------------------------------------------------------


def fail_in_the_background(rank: int, world: int, folder: str) -> list[str]:
    accelerator, model, optimizer, scheduler = _train(1)
    messages = []
    accelerator.save_state(folder)  # fits on the small file system
    saved = accelerator.get_state_dict(model), scheduler.state_dict()
    _step(accelerator, model, optimizer, scheduler, 1)
    accelerator.save_state(folder, async_save=True)  # no room for a second one: fails in the background
    messages.append("returned")
    try:
        accelerator.load_state(folder)
    except BackgroundSaveError as exc:
        messages.append(str(exc))
    accelerator.load_state(folder)  # the failure was raised once; the previous checkpoint loads
    messages.append(str(_same((accelerator.get_state_dict(model), scheduler.state_dict()), saved)))
    return messages


def test_a_background_failure_is_raised_by_the_next_call_that_waits(pool2: WorkerPool, tmp_path: Path) -> None:
    # - Set up: a tmpfs with room for one checkpoint of this model, not for a second one beside it
    probe = tmp_path / "probe"
    pool2.run(save_sync_then_async, str(probe), False)
    size = sum(p.stat().st_size for p in (probe / "sync").rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={(size * 16 // 10 // 4096 + 1) * 4096}", "tmpfs", str(disk)],
                   check=True)  # fmt: skip
    try:
        for returned, message, loaded_previous in pool2.run(fail_in_the_background, str(disk / "ckpt")):
            # - Check: the save returned; the next load raised the ENOSPC naming the file; the old checkpoint loads
            assert returned == "returned" and loaded_previous == "True"
            assert f"no space left on device (ENOSPC) writing '{disk}/ckpt.incomplete/" in message, message
            assert f"The checkpoint at '{disk}/ckpt' is unchanged. The partial save was removed." in message
            assert "async_save=True" in message and "ran in the background" in message
        assert sorted(p.name for p in disk.iterdir()) == ["ckpt"]
    finally:
        subprocess.run(["umount", str(disk)], check=False)

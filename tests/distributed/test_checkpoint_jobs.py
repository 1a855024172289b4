"""Two jobs saving at the same time, each its own process group (world size 1, separate processes).

Saves to sibling folders must not touch each other; a second save to the same folder must stop with an error
naming the first job before either loses anything ([Note: one job per checkpoint folder] in
``checkpoint/transaction.py``).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fullshard.checkpoint import save_sharded
from fullshard.checkpoint.errors import CheckpointBusyError
from fullshard.checkpoint.manifest import read_manifest
from fullshard.checkpoint.transaction import STAGING_TAG, SaveTransaction, staging_folder
from fullshard.checkpoint.verify import verify_checkpoint
from fullshard.testing import WorkerPool
from tests.distributed.test_checkpoint_faults import _train


def save(rank: int, world: int, folder: str, hold: str | None = None, release: str | None = None) -> Any:
    """save_state after one step: ("saved", pid) or ("error", message, pid). With ``hold``, the save stops
    inside its staging folder (after claiming it), touches ``hold`` and waits for ``release`` to exist."""
    accelerator, *_ = _train(1)
    real_step = SaveTransaction.step
    waited = []

    def step(self: SaveTransaction, *args: Any, **kwargs: Any) -> Any:
        if hold is not None and not waited:
            waited.append(True)
            Path(hold).touch()
            deadline = time.monotonic() + 120
            while release is not None and not Path(release).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return real_step(self, *args, **kwargs)

    SaveTransaction.step = step  # type: ignore[method-assign]
    try:
        accelerator.save_state(folder)
    except RuntimeError as exc:
        return ("error", str(exc), os.getpid())
    finally:
        SaveTransaction.step = real_step  # type: ignore[method-assign]
    return ("saved", os.getpid())


@pytest.fixture(scope="module")
def jobs() -> Iterator[tuple[WorkerPool, WorkerPool]]:
    first, second = WorkerPool(1, timeout_s=240), WorkerPool(1, timeout_s=240)
    yield first, second
    first.close()
    second.close()


def _start_holding(pool: WorkerPool, folder: Path, tmp_path: Path) -> tuple[threading.Thread, list[Any], Path]:
    """Job A's save, running in the background until ``release`` is created; returns once A is staging."""
    hold, release = tmp_path / "held", tmp_path / "release"
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(pool.run(save, str(folder), str(hold), str(release))[0]))
    thread.start()
    deadline = time.monotonic() + 180
    while not hold.exists() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hold.exists(), f"job A never reached its staging folder: {result}"
    return thread, result, release


def test_saves_to_sibling_folders_run_side_by_side(jobs: tuple[WorkerPool, WorkerPool], tmp_path: Path) -> None:
    # - Set up: job A is in the middle of saving tmp/a (its staging folder a.incomplete exists)
    pool_a, pool_b = jobs
    thread, result_a, release = _start_holding(pool_a, tmp_path / "a", tmp_path)
    try:
        assert (tmp_path / "a.incomplete").is_dir()
        # - Run: job B saves tmp/b meanwhile, then A finishes
        result_b = pool_b.run(save, str(tmp_path / "b"))[0]
    finally:
        release.touch()
        thread.join(timeout=240)
    # - Check: both saves are whole (before, B deleted A's staging folder and A failed)
    assert result_b[0] == "saved", result_b
    assert result_a and result_a[0][0] == "saved", result_a
    for name in ("a", "b"):
        verify_checkpoint(tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["a", "b"]


def test_a_second_save_to_the_same_folder_names_the_first_job(
    jobs: tuple[WorkerPool, WorkerPool], tmp_path: Path
) -> None:
    # - Set up: a complete checkpoint from job B, then job A saving over it, held in its staging folder
    pool_a, pool_b = jobs
    folder = tmp_path / "ckpt"
    assert pool_b.run(save, str(folder))[0][0] == "saved"
    before = read_manifest(folder).save_id
    thread, result_a, release = _start_holding(pool_a, folder, tmp_path)
    try:
        # - Run: job B saves to the same folder while A is writing it
        result_b = pool_b.run(save, str(folder))[0]
        # - Check: B stops at once, naming A (host and pid); A's staging folder and the old checkpoint are intact
        assert result_b[0] == "error", result_b
        assert f"is being saved by another job (host {socket.gethostname()}, pid " in result_b[1], result_b
        assert f"The checkpoint at '{folder}' is unchanged." in result_b[1]
        assert (tmp_path / "ckpt.incomplete").is_dir()
        assert read_manifest(folder).save_id == before
        verify_checkpoint(folder)
    finally:
        release.touch()
        thread.join(timeout=240)
    # - A's save then completes and replaces the old checkpoint
    assert result_a and result_a[0][0] == "saved", result_a
    assert f"pid {result_a[0][1]}" in result_b[1], "B's error names A's pid"
    verify_checkpoint(folder)
    assert read_manifest(folder).save_id != before
    assert not (tmp_path / "ckpt.incomplete").exists()


def save_busy(rank: int, world: int, folder: str) -> tuple[str, str]:
    """save_sharded into a folder another job is saving: which class each rank caught, and its message."""
    try:
        save_sharded({"w": torch.full((4,), float(rank))}, folder)
    except CheckpointBusyError as exc:
        return ("CheckpointBusyError", str(exc))
    except RuntimeError as exc:
        return (type(exc).__name__, str(exc))
    return ("saved", "")


def test_a_busy_folder_raises_checkpoint_busy_error_on_every_rank(pool2: WorkerPool, tmp_path: Path) -> None:
    # - Set up: the folder's staging folder belongs to a live job on this host (this test's process)
    folder = tmp_path / "ckpt"
    staging = staging_folder(folder)
    staging.mkdir()
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "start": None, "save_id": "feed", "since": 0.0}
    (staging / STAGING_TAG).write_text(json.dumps(owner))
    # - Run: a 2-rank save to that folder
    results = pool2.run(save_busy, str(folder))
    # - Check: the documented class on both ranks (caught by `except CheckpointBusyError`), naming the owner
    for kind, message in results:
        assert kind == "CheckpointBusyError", results
        assert f"pid {os.getpid()}" in message and "is being saved by another job" in message, message
    assert staging.is_dir() and not folder.exists()

"""Every writer creates its files anew: a link planted at a temporary name is never followed ([Note: exclusive
creation] in ``checkpoint/files.py``); staging folders are claimed by one job and deleted only when their owner
is provably gone ([Note: one job per checkpoint folder] in ``checkpoint/transaction.py``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from fullshard.checkpoint import save_sharded, save_weights
from fullshard.checkpoint.checksum import save_with_checksum
from fullshard.checkpoint.manifest import write_json_durably
from fullshard.checkpoint.transaction import (
    STAGING_TAG,
    CheckpointBusyError,
    claim_staging,
    read_owner,
    release_staging,
    staging_folder,
)
from fullshard.cli.main import cli

PRECIOUS = b"precious bytes that no checkpoint writer may touch\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_bytes(PRECIOUS)
    return path


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(8, 4, generator=g) for i in range(3)}


# --- planted links -------------------------------------------------------------------------------------------


def test_merge_weights_does_not_follow_a_planted_partial_link(tmp_path: Path, victim: Path) -> None:
    # - Set up: a sharded checkpoint and OUT/.model.safetensors.partial -> victim
    weights = _weights()
    ckpt = save_sharded({"model": weights}, tmp_path / "pytorch_model_fsdp_0")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".model.safetensors.partial").symlink_to(victim)
    # - Run
    result = CliRunner().invoke(cli, ["merge-weights", str(ckpt), str(out)])
    # - Check: the link's target is untouched, the merge wrote its own file
    assert result.exit_code == 0, result.output
    assert victim.read_bytes() == PRECIOUS
    merged = load_file(out / "model.safetensors")
    assert merged.keys() == weights.keys() and all(torch.equal(merged[k], v) for k, v in weights.items())


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_save_weights_does_not_follow_a_planted_partial_link(tmp_path: Path, victim: Path, safe: bool) -> None:
    name = "model.safetensors" if safe else "pytorch_model.bin"
    out = tmp_path / "out"
    out.mkdir()
    (out / f".{name}.partial").symlink_to(victim)
    (out / name).symlink_to(victim)  # a link at the final name is replaced, never written through
    save_weights(_weights(), out, safe_serialization=safe)
    assert victim.read_bytes() == PRECIOUS
    assert (out / name).is_file() and not (out / name).is_symlink()
    loaded = load_file(out / name) if safe else torch.load(out / name, weights_only=True)
    assert torch.equal(loaded["layer1.weight"], _weights()["layer1.weight"])


def test_small_checkpoint_files_and_manifests_refuse_an_existing_link(tmp_path: Path, victim: Path) -> None:
    link = tmp_path / "scheduler.bin"
    link.symlink_to(victim)
    with pytest.raises(FileExistsError, match=f"a symbolic link to '{victim}' is already there"):
        save_with_checksum({"step": 1}, link)
    assert victim.read_bytes() == PRECIOUS
    # the manifest's temporary file had a fixed name (<name>.tmp) that a link could take
    (tmp_path / ".fullshard_checkpoint.json.tmp").symlink_to(victim)
    write_json_durably(tmp_path / ".fullshard_checkpoint.json", {"files": {}})
    assert victim.read_bytes() == PRECIOUS
    assert json.loads((tmp_path / ".fullshard_checkpoint.json").read_text()) == {"files": {}}


# --- owners of staging folders -------------------------------------------------------------------------------


def _plant_staging(folder: Path, **owner: object) -> Path:
    folder.mkdir()
    tag = {"save_id": "feed", "since": 0.0, "start": None, **owner}
    (folder / STAGING_TAG).write_text(json.dumps(tag))
    (folder / "scheduler.bin").write_bytes(b"partial")
    return folder


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    return int(done.stdout)


def test_only_provably_abandoned_siblings_are_deleted(tmp_path: Path) -> None:
    # - Set up: staging folders beside the target, written by various owners
    host = socket.gethostname()
    dead = _plant_staging(tmp_path / "dead.incomplete", host=host, pid=_dead_pid())
    reused = _plant_staging(tmp_path / "reused.incomplete", host=host, pid=os.getppid(), start="1")  # not its start
    alive = _plant_staging(tmp_path / "alive.incomplete", host=host, pid=os.getppid())
    remote = _plant_staging(tmp_path / "remote.incomplete", host=f"not-{host}", pid=_dead_pid())
    legacy = tmp_path / "legacy.incomplete"
    legacy.mkdir()
    (legacy / STAGING_TAG).write_text("0123abcd")  # fullshard before owners were recorded
    # - Run
    save_id = claim_staging(tmp_path / "ckpt")
    try:
        # - Check: the dead owner's and the reused pid's folders went; a live, a remote and an unknown owner's stay
        assert not dead.exists() and not reused.exists()
        assert alive.is_dir() and remote.is_dir() and legacy.is_dir()
        owner = read_owner(staging_folder(tmp_path / "ckpt"))
        assert owner is not None and (owner.host, owner.pid, owner.save_id) == (host, os.getpid(), save_id)
    finally:
        release_staging(save_id)


def test_a_second_claim_names_the_owner_and_takes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    live = _plant_staging(staging_folder(target), host=socket.gethostname(), pid=os.getppid())
    with pytest.raises(CheckpointBusyError, match=rf"another job \(host {socket.gethostname()}, pid {os.getppid()}"):
        claim_staging(target)
    assert (live / "scheduler.bin").read_bytes() == b"partial"
    remote = tmp_path / "remote"
    _plant_staging(staging_folder(remote), host="elsewhere", pid=1)
    with pytest.raises(CheckpointBusyError, match=r"host elsewhere, pid 1\b"):
        claim_staging(remote)
    # this process's own staging folder, from a save it no longer runs, is abandoned
    mine = tmp_path / "mine"
    first = claim_staging(mine)
    with pytest.raises(CheckpointBusyError, match=f"pid {os.getpid()}"):
        claim_staging(mine)  # the first save is still running
    release_staging(first)
    second = claim_staging(mine)
    release_staging(second)
    assert read_owner(staging_folder(mine)).save_id == second

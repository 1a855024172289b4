"""One rule for every reader of a checkpoint ([Note: one rule for every reader] in ``checkpoint/folder.py``,
[Note: verify is a load] in ``checkpoint/verify.py``): ``load_state``'s checks of a checkpoint, ``load_sharded``
and ``merge_fsdp_weights`` of one of its subfolders, and ``fullshard verify`` of either refuse the same folders,
naming the same file; records removed from a checkpoint fullshard wrote do not make it an unchecked one.

The checkpoint is written in this process by the commit protocol ``save_state`` uses (``SaveTransaction``): a
model and an optimizer folder, a scheduler and a random states file, markers and the manifest.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from fullshard.checkpoint import load_sharded, merge_fsdp_weights
from fullshard.checkpoint.checksum import save_with_checksum
from fullshard.checkpoint.errors import CheckpointDamagedError
from fullshard.checkpoint.manifest import CHECKPOINT_MANIFEST, FOLDER_MARKER
from fullshard.checkpoint.transaction import SaveTransaction
from fullshard.checkpoint.verify import check_parts, verify_checkpoint
from fullshard.checkpoint.writer import write_sharded
from fullshard.cli.main import cli

MODEL, OPTIM = "pytorch_model_fsdp_0", "optimizer_0"


def _model() -> dict[str, Any]:
    return {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6), "b": torch.linspace(0, 1, 5)}


def _optim() -> dict[str, Any]:
    return {"state.w.exp_avg": torch.full((4, 6), 0.5), "state.b.exp_avg": torch.full((5,), 0.25)}


def _empty(part: str) -> dict[str, Any]:
    return {k: torch.zeros_like(v) for k, v in (_model() if part == MODEL else _optim()).items()}


def _save(root: Path) -> Path:
    """A save_state checkpoint, written by the same transaction, with one rank."""
    tx = SaveTransaction(root, "test")
    tx.begin()
    for part, state in ((MODEL, _model()), (OPTIM, _optim())):
        for leaf, record in write_sharded(state, tx.staging / part).items():
            tx.record(f"{part}/{leaf}", record)
    for name, value in (("scheduler.bin", {"last_epoch": 2}), ("random_states_0.pkl", {"seed": 3})):
        tx.record(name, save_with_checksum(value, tx.staging / name))
    return tx.commit()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("readers") / "ck")


@pytest.fixture
def ck(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine, tmp_path / "ck", symlinks=True)
    return tmp_path / "ck"


def _outcome(read: Callable[[], object]) -> str:
    try:
        read()
    except (RuntimeError, ValueError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "read"


def _readers(ck: Path, part: str, tmp_path: Path) -> dict[str, str]:
    """Each reader's outcome: ``read`` or the error it raised."""
    sub = ck / part

    def load() -> None:
        state = _empty(part)
        load_sharded(state, sub)
        want = _model() if part == MODEL else _optim()
        assert all(torch.equal(state[k], want[k]) for k in want), "loaded other values"

    def merge() -> None:
        merge_fsdp_weights(str(sub), str(tmp_path / f"merged-{part}"), show_progress=False)

    return {
        "load_state checks": _outcome(lambda: check_parts(ck)),
        "load_sharded": _outcome(load),
        "merge": _outcome(merge),
        "verify ck": _outcome(lambda: verify_checkpoint(ck)),
        f"verify ck/{part}": _outcome(lambda: verify_checkpoint(sub)),
    }


def _all_refuse(outcomes: dict[str, str], naming: str) -> None:
    bad = {how: what for how, what in outcomes.items() if naming not in what or what == "read"}
    assert not bad, f"not refused naming {naming!r}: {bad}\nall: {outcomes}"


def _edit_marker(ck: Path, part: str, edit: Callable[[dict[str, Any]], None]) -> None:
    path = ck / part / FOLDER_MARKER
    payload = json.loads(path.read_text())
    edit(payload)
    path.write_text(json.dumps(payload, indent=1, sort_keys=True))


def test_the_pristine_checkpoint_reads_every_way(ck: Path, tmp_path: Path) -> None:
    for part in (MODEL, OPTIM):
        outcomes = _readers(ck, part, tmp_path)
        assert set(outcomes.values()) == {"read"}, outcomes
    assert load_file(tmp_path / f"merged-{MODEL}" / "model.safetensors").keys() == _model().keys()


def test_an_edited_item_crc_is_refused_by_verify_as_by_load_naming_the_item(ck: Path, tmp_path: Path) -> None:
    # - Set up: one item's CRC-32 in a marker changed (the marker keeps its size), in the checkpoint and in a
    #   sharded folder of its own (save_sharded's: no manifest above it)
    def edit(payload: dict[str, Any]) -> None:
        payload["files"]["__0_0.distcp"]["items"][0][2] ^= 1

    alone = tmp_path / "alone" / "weights"
    shutil.copytree(ck / MODEL, alone)
    _edit_marker(ck, MODEL, edit)
    _edit_marker(alone.parent, alone.name, edit)
    # - Run / Check: in the checkpoint every reader names the marker (the manifest records its CRC-32) ...
    _all_refuse(_readers(ck, MODEL, tmp_path), f"{MODEL}/{FOLDER_MARKER} is corrupt")
    # ... and alone, load, merge and verify all name the item whose bytes no longer match
    state = _empty(MODEL)
    outcomes = {
        "load_sharded": _outcome(lambda: load_sharded(state, alone)),
        "merge": _outcome(lambda: merge_fsdp_weights(str(alone), str(tmp_path / "m"), show_progress=False)),
        "verify": _outcome(lambda: verify_checkpoint(alone)),
    }
    _all_refuse(outcomes, "is corrupt: the bytes of '")
    result = CliRunner().invoke(cli, ["verify", str(alone)])
    assert result.exit_code == 2 and "is corrupt: the bytes of '" in result.output, result.output


def test_a_subfolder_that_is_a_link_is_refused_by_every_reader(ck: Path, tmp_path: Path) -> None:
    # - Set up: ck/optimizer_0 is a link to the optimizer folder of another, whole save
    other = _save(tmp_path / "other")
    shutil.rmtree(ck / OPTIM)
    (ck / OPTIM).symlink_to(other / OPTIM, target_is_directory=True)
    # - Run / Check
    _all_refuse(_readers(ck, OPTIM, tmp_path), "is a symbolic link")


@pytest.mark.parametrize("damage", ["items lost", "marker deleted"])
def test_a_marker_that_lost_its_items_is_refused_by_merge_as_by_load(ck: Path, tmp_path: Path, damage: str) -> None:
    # - Set up: the optimizer folder's marker without its items, or gone; and a flipped data byte behind it
    if damage == "items lost":
        _edit_marker(ck, OPTIM, lambda p: p["files"]["__0_0.distcp"].pop("items"))
    else:
        (ck / OPTIM / FOLDER_MARKER).unlink()
    data = bytearray((ck / OPTIM / "__0_0.distcp").read_bytes())
    data[-40] ^= 0x10
    (ck / OPTIM / "__0_0.distcp").write_bytes(bytes(data))
    # - Run / Check: refused by all, naming the marker
    _all_refuse(_readers(ck, OPTIM, tmp_path), f"{OPTIM}/{FOLDER_MARKER}")


def test_a_downgraded_checkpoint_is_refused_by_every_reader(ck: Path, tmp_path: Path) -> None:
    # - Set up: the manifest and the optimizer folder's marker deleted, then a data byte flipped
    (ck / CHECKPOINT_MANIFEST).unlink()
    (ck / OPTIM / FOLDER_MARKER).unlink()
    data = bytearray((ck / OPTIM / "__0_0.distcp").read_bytes())
    data[-40] ^= 0x10
    (ck / OPTIM / "__0_0.distcp").write_bytes(bytes(data))
    # - Run / Check: the model folder's marker shows fullshard wrote it: no reader takes it for an unchecked one
    _all_refuse(_readers(ck, OPTIM, tmp_path), f"{CHECKPOINT_MANIFEST} is missing, but fullshard wrote")


def test_verify_names_files_with_other_hard_links(ck: Path, tmp_path: Path) -> None:
    os.link(ck / "scheduler.bin", tmp_path / "elsewhere.bin")
    report = verify_checkpoint(ck)
    assert report.linked == ("scheduler.bin",)
    result = CliRunner().invoke(cli, ["verify", str(ck)])
    assert result.exit_code == 0, result.output
    assert "note: 1 file(s) have other hard links (scheduler.bin)" in result.output


class _Evil:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("echo pwned",))


def test_verify_reads_plain_files_as_a_load_does_without_a_manifest(ck: Path) -> None:
    # - Set up: a checkpoint without records (as Accelerate writes one) whose scheduler file is a crafted pickle
    (ck / CHECKPOINT_MANIFEST).unlink()
    for marker in ck.glob(f"*/{FOLDER_MARKER}"):
        marker.unlink()
    torch.save({"x": _Evil()}, ck / "scheduler.bin", pickle_protocol=2)
    # - Run / Check: the safe unpickler that load_state reads it with refuses it, and so does verify
    with pytest.raises(CheckpointDamagedError, match=r"scheduler.bin was refused: it asks for posix.system"):
        verify_checkpoint(ck)

"""load_state on 2 ranks keeps to the checkpoint folder: a symlinked small file, a ``.metadata`` entry that
leads out of the folder, and a marker item moved together with a flipped byte of that item are refused on
every rank, naming the entry (see [Note: a checkpoint folder is a boundary] in ``checkpoint/boundary.py``)."""

from __future__ import annotations

import json
import pickle
import shutil
import zlib
from pathlib import Path

from fullshard.checkpoint.manifest import CHECKPOINT_MANIFEST, FOLDER_MARKER
from fullshard.checkpoint.reader import read_metadata
from fullshard.testing import WorkerPool
from tests.distributed.test_checkpoint_faults import _same, load_each, save_after


def _record(folder: Path, name: str) -> None:
    """Record ``name``'s current bytes in the manifest (and its folder's marker), as a crafter would."""
    data = (folder / name).read_bytes()
    sub, _, leaf = name.rpartition("/")
    if sub:
        marker = json.loads((folder / sub / FOLDER_MARKER).read_text())
        marker["files"][leaf].update(size=len(data), crc32=zlib.crc32(data))
        (folder / sub / FOLDER_MARKER).write_text(json.dumps(marker))
    manifest = json.loads((folder / CHECKPOINT_MANIFEST).read_text())
    for listed in [name, f"{sub}/{FOLDER_MARKER}"] if sub else [name]:
        data = (folder / listed).read_bytes()
        manifest["files"][listed].update(size=len(data), crc32=zlib.crc32(data))
    (folder / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest))


def _symlinked_scheduler(folder: Path, outside: Path) -> None:
    shutil.move(folder / "scheduler.bin", outside / "scheduler.bin")  # identical bytes: only the place is wrong
    (folder / "scheduler.bin").symlink_to(outside / "scheduler.bin")


def _entry_out_of_the_folder(folder: Path, outside: Path) -> None:
    model = folder / "pytorch_model_fsdp_0"
    shutil.copy(model / "__0_0.distcp", outside / "x.distcp")
    metadata = read_metadata(model)
    for info in metadata.storage_data.values():
        if info.relative_path == "__0_0.distcp":
            object.__setattr__(info, "relative_path", "../../outside/x.distcp")
    (model / ".metadata").write_bytes(pickle.dumps(metadata))
    _record(folder, "pytorch_model_fsdp_0/.metadata")


def _double_fault(folder: Path, outside: Path) -> None:
    model = folder / "pytorch_model_fsdp_0"
    marker = json.loads((model / FOLDER_MARKER).read_text())
    item = max(marker["files"]["__0_0.distcp"]["items"], key=lambda i: i[1])  # the largest item
    offset, length = item[0], item[1]
    item[0] = offset + (1 if offset % 10 < 9 else -1)  # same number of digits: the marker keeps its size
    (model / FOLDER_MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True))  # as written: same size
    data = bytearray((model / "__0_0.distcp").read_bytes())
    data[offset + length - 8] ^= 0x01
    (model / "__0_0.distcp").write_bytes(bytes(data))
    manifest = json.loads((folder / CHECKPOINT_MANIFEST).read_text())  # the marker's CRC-32, as a crafter would
    written = (model / FOLDER_MARKER).read_bytes()
    manifest["files"][f"pytorch_model_fsdp_0/{FOLDER_MARKER}"].update(size=len(written), crc32=zlib.crc32(written))
    (folder / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest))


CRAFTS = {
    "symlinked scheduler.bin": (_symlinked_scheduler, "'scheduler.bin' of .fullshard_checkpoint.json is a symbolic"),
    "entry out of the folder": (_entry_out_of_the_folder, "'../../outside/x.distcp' of .metadata leads out"),
    "double fault": (_double_fault, "but .fullshard_complete.json records no item there"),
}


def test_load_state_refuses_what_points_outside_or_is_unlisted(pool2: WorkerPool, tmp_path: Path) -> None:
    want = pool2.run(save_after, str(tmp_path / "ckpt"), 1)[0]
    folders = []
    for i, (craft, _) in enumerate(CRAFTS.values()):
        folder = tmp_path / f"crafted{i}" / "ckpt"
        (folder.parent / "outside").mkdir(parents=True)
        shutil.copytree(tmp_path / "ckpt", folder)
        craft(folder, folder.parent / "outside")
        folders.append(str(folder))
    per_rank = pool2.run(load_each, [str(tmp_path / "ckpt"), *folders])
    assert _same(per_rank[0][0], want)  # the pristine checkpoint loads (rank 0 gathers the full state)
    for got in per_rank:
        for (name, (_, expected)), result in zip(CRAFTS.items(), got[1:], strict=True):
            assert isinstance(result, str), f"{name}: loaded"
            assert result.startswith("CheckpointDamagedError") and expected in result, (name, result)
    assert per_rank[0][1:] == per_rank[1][1:]  # the same message on every rank

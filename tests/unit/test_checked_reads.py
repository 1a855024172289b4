"""Checked reads: every load checks each stored item it reads whole against the CRC-32 recorded at save time.

The reference for the recorded checksums is zlib's CRC-32 of the file's bytes at each item's span; the
damage sweep changes every byte of a small checkpoint in turn and requires a named refusal each time.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from fullshard.checkpoint import load_sharded, merge_fsdp_weights, save_sharded
from fullshard.checkpoint.checksum import crc32_combine, item_checksums
from fullshard.checkpoint.manifest import FOLDER_MARKER
from fullshard.checkpoint.reader import read_metadata
from fullshard.checkpoint.verify import CheckpointDamagedError

pytestmark = pytest.mark.skipif(crc32_combine is None, reason="checked reads need ISA-L (the isal package)")


def _state() -> dict:
    return {
        "w": torch.arange(60, dtype=torch.float32).reshape(6, 10),
        "b": torch.ones(7),
        "step": 3,
        "nested": {"x": torch.full((3, 4), 2.5, dtype=torch.bfloat16)},
    }


def _empty() -> dict:
    return {
        "w": torch.zeros(6, 10),
        "b": torch.zeros(7),
        "step": 0,
        "nested": {"x": torch.zeros(3, 4, dtype=torch.bfloat16)},
    }


def _equal(a: dict, b: dict) -> bool:
    return (
        torch.equal(a["w"], b["w"])
        and torch.equal(a["b"], b["b"])
        and a["step"] == b["step"]
        and torch.equal(a["nested"]["x"], b["nested"]["x"])
    )


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return save_sharded(_state(), tmp_path / "ckpt")


def test_the_marker_records_each_items_crc_as_zlib_computes_it(saved: Path) -> None:
    marker = json.loads((saved / FOLDER_MARKER).read_text())
    spans = {(info.relative_path, info.offset, info.length) for info in read_metadata(saved).storage_data.values()}
    recorded = {(name, o, n): crc for name, rec in marker["files"].items() for o, n, crc in rec.get("items", [])}
    assert set(recorded) == spans  # every stored item, nothing else
    for (name, offset, length), crc in recorded.items():
        data = (saved / name).read_bytes()
        assert crc == zlib.crc32(data[offset : offset + length])
    loaded = _empty()
    load_sharded(loaded, saved)
    assert _equal(loaded, _state())


def _refused_at_each(saved: Path, path: Path, positions: list[int]) -> None:
    """Flip one bit at each position in turn: every load must be refused naming the file; the file is restored."""
    original = path.read_bytes()
    for position in positions:
        damaged = bytearray(original)
        damaged[position] ^= 1 << (position % 8)
        path.write_bytes(bytes(damaged))
        with pytest.raises(CheckpointDamagedError) as caught:
            load_sharded(_empty(), saved)
        assert str(caught.value).startswith(f"{path} is corrupt"), (position, str(caught.value))
    path.write_bytes(original)
    loaded = _empty()
    load_sharded(loaded, saved)
    assert _equal(loaded, _state())


def test_every_changed_byte_of_the_metadata_is_refused_naming_the_file(saved: Path) -> None:
    path = saved / ".metadata"
    _refused_at_each(saved, path, list(range(path.stat().st_size)))


def test_every_byte_of_a_data_file_is_in_a_checked_item_and_a_change_in_each_item_is_refused(saved: Path) -> None:
    # The items' recorded spans tile the data file, so each byte is under one item's CRC-32, which changes with
    # any single flipped bit; then a flip at each item's first, middle and last byte (and at every 31st byte) is
    # refused through the whole load path. (Flipping every byte took 45 s for the same proof.)
    path = saved / "__0_0.distcp"
    spans = sorted(
        (info.offset, info.length)
        for info in read_metadata(saved).storage_data.values()
        if info.relative_path == path.name
    )
    covered = 0
    for offset, length in spans:
        assert offset == covered and length > 0, (spans, covered)  # contiguous, no gap, no overlap
        covered += length
    assert covered == path.stat().st_size, (spans, path.stat().st_size)
    positions = {p for offset, length in spans for p in (offset, offset + length // 2, offset + length - 1)}
    _refused_at_each(saved, path, sorted(positions | set(range(0, covered, 31))))


def test_merge_refuses_a_damaged_item_without_verify(saved: Path, tmp_path: Path) -> None:
    path = saved / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamagedError, match=r"__0_0\.distcp is corrupt: the bytes of "):
        merge_fsdp_weights(str(saved), str(tmp_path / "merged"))
    assert not list((tmp_path / "merged").glob("*"))  # no weights file, whole or partial


def test_a_folder_without_item_checksums_still_loads(saved: Path, tmp_path: Path) -> None:
    # Saved by Accelerate, torch, or an older fullshard: no "items" in the marker (or no marker at all).
    marker = json.loads((saved / FOLDER_MARKER).read_text())
    for record in marker["files"].values():
        record.pop("items", None)
    (saved / FOLDER_MARKER).write_text(json.dumps(marker))
    loaded = _empty()
    load_sharded(loaded, saved)
    assert _equal(loaded, _state())
    bare = Path(shutil.copytree(saved, tmp_path / "bare"))
    (bare / FOLDER_MARKER).unlink()
    loaded = _empty()
    load_sharded(loaded, bare)
    assert _equal(loaded, _state())


def test_item_checksums_combine_pieces_and_leave_out_unaligned_spans() -> None:
    rng = random.Random(0)
    blob = bytes(rng.randrange(256) for _ in range(5000))
    cuts = sorted({0, len(blob), *rng.sample(range(1, len(blob)), 40)})
    pieces = [(a, b - a, zlib.crc32(blob[a:b])) for a, b in itertools.pairwise(cuts)]
    aligned = [(cuts[i], cuts[j] - cuts[i]) for i, j in [(0, 1), (0, len(cuts) - 1), (3, 17), (17, 18)]]
    unaligned = [(cuts[3] + 1, 10), (cuts[3], cuts[4] - cuts[3] + 1), (len(blob), 0)]
    got = item_checksums(pieces, aligned + unaligned)
    assert got == tuple(sorted((o, n, zlib.crc32(blob[o : o + n])) for o, n in aligned))

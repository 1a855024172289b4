"""A checkpoint folder is a boundary: load, merge and verify open only files inside it, never through a link,
and never read an item the marker does not list when it lists any (see [Note: a checkpoint folder is a
boundary] in ``checkpoint/boundary.py``).

Each test crafts a checkpoint as an attacker would (``.metadata`` re-pickled and its recorded CRC-32 updated, so
the checksum does not catch it) and requires a refusal that names the entry, with the file outside never
opened (an audit hook watches every ``open``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from fullshard.checkpoint import load_sharded, merge_fsdp_weights, save_sharded
from fullshard.checkpoint.boundary import entry_path
from fullshard.checkpoint.checksum import crc32_combine
from fullshard.checkpoint.manifest import FOLDER_MARKER
from fullshard.checkpoint.names import DCP_METADATA_FILE
from fullshard.checkpoint.reader import read_metadata
from fullshard.checkpoint.verify import CheckpointDamagedError, verify_checkpoint

# --- opens, watched -----------------------------------------------------------------------------------------------

_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # cannot be removed; records only inside `_opens()`


@contextlib.contextmanager
def _opens() -> Iterator[list[str]]:
    global _OPENED
    _OPENED = []
    try:
        yield _OPENED
    finally:
        _OPENED = None


# --- a saved checkpoint and the crafting helpers --------------------------------------------------------------------


def _state() -> dict:
    return {"w": torch.arange(60, dtype=torch.float32).reshape(6, 10), "b": torch.ones(7), "step": 3}


def _empty() -> dict:
    return {"w": torch.zeros(6, 10), "b": torch.zeros(7), "step": 0}


def _equal(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return save_sharded(_state(), tmp_path / "ckpt")


def _elsewhere(tmp_path: Path, saved: Path) -> Path:
    """A copy of the checkpoint's data file outside it, other values in it: what a crafted entry would read."""
    other = save_sharded({"w": torch.full((6, 10), 7.0), "b": torch.full((7,), 7.0), "step": 9}, tmp_path / "other")
    target = tmp_path / "elsewhere" / "x.distcp"
    target.parent.mkdir()
    shutil.copy(other / "__0_0.distcp", target)
    return target


def _set_marker_crc(folder: Path, name: str, data: bytes) -> None:
    """Record ``data`` as ``name``'s bytes in the folder's marker, as a crafter would."""
    marker = json.loads((folder / FOLDER_MARKER).read_text())
    marker["files"][name].update(size=len(data), crc32=zlib.crc32(data))
    (folder / FOLDER_MARKER).write_text(json.dumps(marker))


def _craft_metadata(folder: Path, edit: Callable[[object], None]) -> None:
    """Rewrite ``.metadata`` with ``edit`` applied to every storage entry, and its CRC-32 in the marker."""
    metadata = read_metadata(folder)
    for info in metadata.storage_data.values():
        edit(info)
    data = pickle.dumps(metadata)
    (folder / DCP_METADATA_FILE).write_bytes(data)
    _set_marker_crc(folder, DCP_METADATA_FILE, data)


def _set(**fields: object) -> Callable[[object], None]:
    return lambda info: [object.__setattr__(info, k, v) for k, v in fields.items()]


def _merge(folder: Path) -> None:
    merge_fsdp_weights(str(folder), str(folder.parent / "merged"))


def _load(folder: Path) -> None:
    loaded = _empty()
    load_sharded(loaded, folder)
    assert _equal(loaded, _state()), "loaded values other than the ones saved"


READERS = {"load_sharded": _load, "merge": _merge, "verify": verify_checkpoint}


def _refused(read: Callable[[Path], object], folder: Path, entry: str, outside: Path) -> str:
    with _opens() as opened, pytest.raises(CheckpointDamagedError) as caught:
        read(folder)
    message = str(caught.value)
    assert repr(entry) in message, message
    assert str(outside.resolve()) not in opened, "a file outside the checkpoint was opened"
    return message


# --- traversal ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reader", READERS)
def test_a_relative_path_out_of_the_folder_is_refused(saved: Path, tmp_path: Path, reader: str) -> None:
    outside = _elsewhere(tmp_path, saved)
    _craft_metadata(saved, _set(relative_path="../elsewhere/x.distcp"))
    message = _refused(READERS[reader], saved, "../elsewhere/x.distcp", outside)
    assert "leads out of the folder" in message and "Load another checkpoint" in message


@pytest.mark.parametrize("reader", READERS)
def test_an_absolute_path_is_refused(saved: Path, tmp_path: Path, reader: str) -> None:
    outside = _elsewhere(tmp_path, saved)
    _craft_metadata(saved, _set(relative_path=str(outside)))
    assert "is an absolute path" in _refused(READERS[reader], saved, str(outside), outside)


@pytest.mark.parametrize("reader", READERS)
def test_a_system_file_is_refused_without_revealing_its_size(saved: Path, reader: str) -> None:
    system = Path("/etc/passwd") if Path("/etc/passwd").is_file() else Path(sys.executable)
    size = system.stat().st_size
    _craft_metadata(saved, _set(relative_path=str(system), offset=size + 100))  # longer than the file
    message = _refused(READERS[reader], saved, str(system), system)
    assert str(size) not in message, message


def test_offsets_and_lengths_that_are_not_byte_counts_are_refused(saved: Path) -> None:
    _craft_metadata(saved, _set(length=-5))
    with pytest.raises(CheckpointDamagedError, match=r"is damaged: the entry of '\w+' in '__0_0.distcp' has offset"):
        _load(saved)


# --- symbolic links -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("name", ["__0_0.distcp", DCP_METADATA_FILE, FOLDER_MARKER])
def test_a_symlinked_file_is_refused(saved: Path, tmp_path: Path, reader: str, name: str) -> None:
    # The link points at an identical copy: following it would load the right values, but from outside.
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    shutil.move(saved / name, outside)
    (saved / name).symlink_to(outside)
    message = _refused(READERS[reader], saved, name, outside)
    assert "symbolic link" in message


def test_a_link_that_stays_inside_is_refused_too(saved: Path) -> None:
    (saved / "__0_0.distcp").rename(saved / "real.distcp")
    (saved / "__0_0.distcp").symlink_to("real.distcp")
    with pytest.raises(CheckpointDamagedError, match=r"'__0_0.distcp' of .fullshard_complete.json is a symbolic"):
        _load(saved)


def test_the_folder_itself_may_be_a_link(saved: Path, tmp_path: Path) -> None:
    (tmp_path / "latest").symlink_to(saved)
    _load(tmp_path / "latest")
    assert entry_path(tmp_path / "latest", "__0_0.distcp") == tmp_path / "latest" / "__0_0.distcp"


# --- the double fault ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(crc32_combine is None, reason="per-item checksums need ISA-L (the isal package)")
@pytest.mark.parametrize("reader", ["load_sharded", "merge"])
def test_a_moved_marker_item_and_a_flipped_byte_are_refused(saved: Path, reader: str) -> None:
    # One item's offset changed in the marker (its CRC no longer applies to it) and a byte of that item flipped.
    metadata = read_metadata(saved)
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == "w")
    marker = json.loads((saved / FOLDER_MARKER).read_text())
    items = marker["files"]["__0_0.distcp"]["items"]
    item = next(i for i in items if i[0] == info.offset)
    item[0] += 1
    (saved / FOLDER_MARKER).write_text(json.dumps(marker))
    data = bytearray((saved / "__0_0.distcp").read_bytes())
    data[info.offset + info.length - 8] ^= 0x01  # inside w's last value
    (saved / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointDamagedError) as caught:
        READERS[reader](saved)
    assert f"places 'w' at offset {info.offset} ({info.length} bytes), but .fullshard_complete.json records no item" \
        in str(caught.value)  # fmt: skip


@pytest.mark.skipif(crc32_combine is None, reason="per-item checksums need ISA-L (the isal package)")
def test_without_any_item_checksums_nothing_is_required(saved: Path) -> None:
    marker = json.loads((saved / FOLDER_MARKER).read_text())
    for record in marker["files"].values():
        record.pop("items", None)
    (saved / FOLDER_MARKER).write_text(json.dumps(marker))
    _load(saved)

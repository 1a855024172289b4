"""The checkpoint manifest: the file that makes a ``save_state`` folder complete, and what it records.

A folder written by ``Accelerator.save_state`` is complete when it holds :data:`CHECKPOINT_MANIFEST`
(``.fullshard_checkpoint.json``), which the save writes last, after every rank's files are on disk, and just
before the folder is renamed into place (see [Note: whole-checkpoint commit] in ``transaction.py``)::

    {"format": "fullshard.save_state", "version": 1, "save_id": "<uuid4 hex>", "world_size": 2,
     "files": {"pytorch_model_fsdp_0/__0_0.distcp": {"size": 123, "crc32": 456}, ...}}

``files`` lists every file of the checkpoint (relative POSIX paths; the manifest itself excluded) with its
size in bytes and its CRC-32 (``zlib.crc32``, computed while the bytes were written: ``checksum.py``).
Sharded (DCP) subfolders also hold their own marker (:data:`FOLDER_MARKER`, same ``files`` schema relative
to the subfolder, plus the ``save_id``) so that one subfolder can be verified or merged alone, and so that a
subfolder copied in from another save is recognised by its ``save_id``. In a marker, each DCP data file's
record also lists its items, ``"items": [[offset, length, crc32], ...]``: the CRC-32 of each stored item's
bytes, which every load checks as it reads them (``reader.py``, [Note: checked reads]). The top-level
manifest leaves the items out.

Folders without a manifest are either partial saves (refused) or checkpoints written by Accelerate or an
older fullshard, which are complete by the legacy rule of :func:`fullshard.checkpoint.folder.checkpoint_state`
(``folder.py`` decides what a folder is; this module only reads and writes the records).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fullshard.checkpoint.boundary import entry_path
from fullshard.checkpoint.files import write_replacing
from fullshard.checkpoint.names import CHECKPOINT_MANIFEST, FOLDER_MARKER, STAGING_SUFFIX

__all__ = [
    "CHECKPOINT_MANIFEST",
    "FOLDER_MARKER",
    "FileRecord",
    "ItemChecksum",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "STAGING_SUFFIX",
    "Manifest",
    "read_folder_marker",
    "read_manifest",
    "write_json_durably",
]

MANIFEST_FORMAT = "fullshard.save_state"
MANIFEST_VERSION = 1


ItemChecksum = tuple[int, int, int]
"""One stored item of a DCP data file: ``(offset, length, crc32)`` of its bytes in the file."""


@dataclass(frozen=True)
class FileRecord:
    """One file as it was written: its size in bytes, its CRC-32 (``None`` when none was recorded) and, for a
    DCP data file, the CRC-32 of each stored item (empty when none were recorded)."""

    size: int
    crc32: int | None = None
    items: tuple[ItemChecksum, ...] = ()

    def to_json(self, *, items: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size}
        if self.crc32 is not None:
            out["crc32"] = self.crc32
        if items and self.items:
            out["items"] = [list(item) for item in self.items]
        return out


def _parse_items(raw: object) -> tuple[ItemChecksum, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(
        isinstance(item, list) and len(item) == 3 and all(type(v) is int and v >= 0 for v in item) for item in raw
    ):
        raise ValueError("'items' is not a list of [offset, length, crc32]")
    return tuple((item[0], item[1], item[2]) for item in raw)


@dataclass(frozen=True)
class Manifest:
    """A parsed :data:`CHECKPOINT_MANIFEST` (or :data:`FOLDER_MARKER`: ``world_size`` may then be 0)."""

    path: Path
    save_id: str | None
    world_size: int
    files: dict[str, FileRecord]


def write_json_durably(path: Path, payload: object) -> None:
    """Write ``payload`` as JSON to ``path`` through a new temporary file, fsync'd, then renamed into place.

    The temporary file is created exclusively and the rename does not follow a link at ``path``: see
    [Note: exclusive creation] in ``files.py``.
    """
    write_replacing(path, lambda f: f.write(json.dumps(payload, indent=1, sort_keys=True).encode()))


def _parse_files(raw: object, path: Path) -> dict[str, FileRecord]:
    if not isinstance(raw, dict):
        raise ValueError("'files' is not an object")
    files = {}
    for name, record in raw.items():
        if isinstance(record, int):  # older fullshard markers: sizes only
            files[name] = FileRecord(record)
        elif isinstance(record, dict) and isinstance(record.get("size"), int):
            crc = record.get("crc32")
            files[name] = FileRecord(
                record["size"], crc if isinstance(crc, int) else None, _parse_items(record.get("items"))
            )
        else:
            raise ValueError(f"the entry of {name!r} is not a file record")
        entry_path(path.parent, name, listed_in=path.name)  # see [Note: a checkpoint folder is a boundary]
    return files


def _read(folder: str | os.PathLike[str], name: str) -> Manifest | None:
    path = entry_path(folder, name)  # a marker that is a symbolic link is refused, not followed
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        files = _parse_files(raw["files"], path)
        save_id = raw.get("save_id")
        world = raw.get("world_size", 0)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RuntimeError(
            f"{path} is corrupt ({type(exc).__name__}: {exc}); the checkpoint in {path.parent} cannot be trusted. "
            "Load an earlier checkpoint."
        ) from None
    return Manifest(path, save_id if isinstance(save_id, str) else None, world if isinstance(world, int) else 0, files)


def read_manifest(folder: str | os.PathLike[str]) -> Manifest | None:
    """The checkpoint manifest of ``folder`` (``None`` if it has none); a corrupt one raises naming the file."""
    return _read(folder, CHECKPOINT_MANIFEST)


def read_folder_marker(folder: str | os.PathLike[str]) -> Manifest | None:
    """The completion marker of one sharded (DCP) subfolder (``None`` if it has none)."""
    return _read(folder, FOLDER_MARKER)

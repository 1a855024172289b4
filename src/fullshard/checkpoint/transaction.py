"""One ``save_state`` is one atomic unit: every part is staged in one folder that is renamed into place whole.

[Note: whole-checkpoint commit]
``SaveTransaction(dir)`` (a collective over the process group; every rank makes the same calls):

1. ``begin``: rank 0 deletes abandoned staging folders next to ``dir`` (siblings named ``*.incomplete`` that
   hold :data:`STAGING_TAG` or a manifest: left by a save that was killed), puts back ``dir.previous`` if a
   commit was killed between its two renames, and creates ``dir.incomplete`` holding the tag and a fresh
   ``save_id``, which every rank receives.
2. ``step(fn)``: every rank writes its files into the staging folder (model and optimizer folders through
   DCP, the small files with ``torch.save``), each file checksummed as it is written; each rank reports the
   files it wrote (``record``). After every step all ranks agree; a failure on any rank makes every rank
   raise the same message, naming the failing ranks and why (a full disk is called a full disk), and rank 0
   deletes the staging folder.
3. ``commit``: rank 0 gathers every rank's records, checks each file's size on disk, writes the completion
   marker of each sharded subfolder and then the checkpoint manifest (``manifest.py``) with every file's
   size and CRC-32, moves an existing ``dir`` aside to ``dir.previous``, renames the staging folder to
   ``dir``, deletes ``dir.previous`` and fsyncs the parent folder.

A save killed at any point (any rank, SIGKILL or SIGTERM) therefore leaves ``dir`` as it was, or, if killed
between the two renames of step 3, leaves the previous checkpoint whole in ``dir.previous`` (which
``load_state`` falls back to, and the next save puts back). The staging folder is never a complete
checkpoint (its name ends in ``.incomplete`` and, until the last moment, it has no manifest), so it is never
loaded or taken as the latest; the next save into the same parent folder deletes it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fullshard.checkpoint.checksum import file_checksum
from fullshard.checkpoint.collective import run_everywhere
from fullshard.checkpoint.manifest import (
    CHECKPOINT_MANIFEST,
    FOLDER_MARKER,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    STAGING_SUFFIX,
    FileRecord,
    write_json_durably,
)
from fullshard.ranks import gather_from_ranks, rank_and_world

__all__ = ["PREVIOUS_SUFFIX", "STAGING_TAG", "SaveTransaction", "fsync_dir", "previous_folder", "staging_folder"]

STAGING_TAG = ".fullshard_staging"
PREVIOUS_SUFFIX = ".previous"


def staging_folder(target: Path) -> Path:
    return target.with_name(target.name + STAGING_SUFFIX)


def previous_folder(target: Path) -> Path:
    return target.with_name(target.name + PREVIOUS_SUFFIX)


def fsync_dir(folder: Path) -> None:
    # Makes renames durable; not every platform can open a directory (Windows), which is fine to skip.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _abandoned_staging(parent: Path) -> list[Path]:
    if not parent.is_dir():
        return []
    return [p for p in parent.iterdir() if p.name.endswith(STAGING_SUFFIX) and p.is_dir()
            and ((p / STAGING_TAG).is_file() or (p / CHECKPOINT_MANIFEST).is_file())]  # fmt: skip


class SaveTransaction:
    """Stages one checkpoint folder on every rank and commits it whole. See [Note: whole-checkpoint commit]."""

    def __init__(self, target: str | os.PathLike[str], where: str, process_group: dist.ProcessGroup | None = None):
        self.target = Path(target)
        self.staging = staging_folder(self.target)
        self.where = where
        self.process_group = process_group
        self.rank, self.world = rank_and_world(process_group)
        self.save_id = ""
        self.records: dict[str, FileRecord] = {}  # this rank's files, relative to the staging folder

    # --- steps --------------------------------------------------------------------------------------

    def begin(self) -> None:
        """Clean up after killed saves and create the staging folder (a collective)."""
        found, _, failed = run_everywhere(self._prepare if self.rank == 0 else lambda: None, self.process_group)
        if failed:
            self._raise("preparing the staging folder", failed, cleanup=False)
        ids: list[Any] = [found]
        if self.world > 1:
            dist.broadcast_object_list(ids, src=dist.get_global_rank(self.process_group, 0)
                                       if self.process_group is not None else 0)  # fmt: skip
        self.save_id = ids[0]

    def step(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on every rank; if it failed anywhere, every rank raises and the staging folder goes."""
        result, _, failed = run_everywhere(fn, self.process_group)
        if failed:
            self._raise(what, failed, cleanup=True)
        return result

    def record(self, relative: str, record: FileRecord) -> None:
        self.records[relative] = record

    def commit(self) -> Path:
        """Write the markers and the manifest, then rename the staging folder into place (a collective)."""
        merged: dict[str, FileRecord] = {}
        for records in gather_from_ranks(self.records, self.process_group):
            merged.update(records)
        self.step("committing", lambda: self._commit(merged) if self.rank == 0 else None)
        return self.target

    # --- rank 0 -------------------------------------------------------------------------------------

    def _prepare(self) -> str:
        parent = self.target.parent
        for stale in _abandoned_staging(parent):
            shutil.rmtree(stale, ignore_errors=True)
        previous = previous_folder(self.target)
        if previous.is_dir():
            if self.target.exists():
                shutil.rmtree(previous)
            else:  # a commit was killed between its two renames: the previous checkpoint is whole there
                os.replace(previous, self.target)
        if self.staging.exists():
            shutil.rmtree(self.staging)
        self.staging.mkdir(parents=True)
        save_id = uuid.uuid4().hex
        (self.staging / STAGING_TAG).write_text(save_id)
        return save_id

    def _commit(self, files: dict[str, FileRecord]) -> None:
        for name, record in sorted(files.items()):
            path = self.staging / name
            size = path.stat().st_size if path.is_file() else None
            if size != record.size:
                raise RuntimeError(f"{path} is {size} bytes on disk after writing {record.size}")
        by_folder: dict[str, dict[str, FileRecord]] = {}
        for name, record in files.items():
            folder, _, leaf = name.rpartition("/")
            if folder:
                by_folder.setdefault(folder, {})[leaf] = record
        listed = dict(files)
        for folder, members in sorted(by_folder.items()):
            marker = self.staging / folder / FOLDER_MARKER
            write_json_durably(marker, self._payload(members, items=True))
            listed[f"{folder}/{FOLDER_MARKER}"] = file_checksum(marker)
        write_json_durably(self.staging / CHECKPOINT_MANIFEST, self._payload(listed, items=False))
        (self.staging / STAGING_TAG).unlink()
        fsync_dir(self.staging)
        previous = previous_folder(self.target)
        if self.target.exists():
            os.replace(self.target, previous)
        os.replace(self.staging, self.target)
        if previous.exists():
            shutil.rmtree(previous)
        fsync_dir(self.target.parent)

    def _payload(self, files: dict[str, FileRecord], *, items: bool) -> dict[str, Any]:
        """A marker (``items``: with each data file's item checksums) or the manifest (without)."""
        return {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "save_id": self.save_id,
            "world_size": self.world,
            "files": {name: record.to_json(items=items) for name, record in sorted(files.items())},
        }

    # --- failure ------------------------------------------------------------------------------------

    def _raise(self, what: str, failed: dict[int, str], *, cleanup: bool) -> None:
        removed = ""
        if cleanup and self.rank == 0:
            shutil.rmtree(self.staging, ignore_errors=True)
        if cleanup:
            removed = " The partial save was removed."
        reasons = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failed.items()))
        raise RuntimeError(
            f"{self.where}: {what} failed on rank(s) {sorted(failed)} ({reasons}). The checkpoint at "
            f"'{self.target}' is unchanged.{removed}"
        )

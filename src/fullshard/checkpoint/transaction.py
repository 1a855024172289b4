"""One save is one atomic unit: every part is staged in one folder that is renamed into place whole.

The one commit protocol of the package: ``save_state`` commits a checkpoint folder with it, and
``save_sharded`` commits one sharded folder with it (``SaveTransaction(dir, sharded_folder=True)``: a
one-folder transaction, whose marker goes at the top of the folder and which has no manifest).

[Note: whole-checkpoint commit]
``SaveTransaction(dir)`` (a collective over the process group; every rank makes the same calls):

1. ``begin``: rank 0 claims ``dir.incomplete`` (the staging folder) for this job: it creates it exclusively
   and writes :data:`STAGING_TAG` there (this job's host, pid, process start time and a fresh ``save_id``,
   which every rank receives); see [Note: one job per checkpoint folder]. It deletes only staging folders
   next to ``dir`` whose owner is provably gone, and puts back ``dir.previous`` if a commit was killed between
   its two renames.
2. ``step(fn)``: every rank writes its files into the staging folder (``write_sharded``: model and optimizer
   folders through DCP; ``write_file``: the small files with ``torch.save``), each file checksummed as it is
   written and recorded. After every step all ranks agree; a failure on any rank makes every rank
   raise the same message, naming the failing ranks and why (a full disk is called a full disk), and rank 0
   deletes the staging folder.
3. ``commit``: rank 0 gathers every rank's records, checks each file's size on disk (``folder.py``), writes
   the completion marker of each sharded subfolder and then the checkpoint manifest (``manifest.py``) with
   every file's size and CRC-32, also of the files the caller wrote into the staging folder itself, such as
   ``save_state``'s pre-hooks' (a one-folder transaction: the folder's own marker only), moves an existing
   ``dir`` aside to ``dir.previous``, renames the staging folder to ``dir``, deletes ``dir.previous`` and
   fsyncs the parent folder. The staging tag goes last, with the rename (it is the lock on ``dir``).

A save killed at any point (any rank, SIGKILL or SIGTERM) therefore leaves ``dir`` as it was, or, if killed
between the two renames of step 3, leaves the previous checkpoint whole in ``dir.previous`` (which
``load_state`` falls back to, and the next save puts back). The staging folder is never a complete
checkpoint (its name ends in ``.incomplete`` and, until the last moment, it has no manifest), so it is never
loaded or taken as the latest; the next save into the same parent folder deletes it once its owner is gone.

[Note: one job per checkpoint folder]
The staging folder ``dir.incomplete`` is the lock on ``dir``: ``os.mkdir`` creates it for one job only,
and its tag names the owner (``{"host", "pid", "start", "save_id", "since"}``; ``start`` is the process
start time from ``/proc``, so a reused pid is not mistaken for the owner). A second job saving to ``dir``
finds the folder there and raises :class:`CheckpointBusyError` naming the owner, before it writes or deletes
anything; the owner's save goes on. A staging folder is *abandoned*, and may be deleted by any save to the
same folder or a sibling, only when its owner is provably gone: same host, and that pid is dead or now
another process (or it is this very process, which is not saving it). A staging folder owned by another
host is never deleted (fullshard cannot see that host's processes), nor one whose tag is missing or from a
fullshard before 2026-11-26: a save to that folder raises and says to delete it by hand if no job writes it.
Saves to sibling folders never touch each other's staging folders. An abandoned folder is first renamed
aside and its tag read again: when two jobs clean up at once, a folder a third one has just claimed is put back.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fullshard.checkpoint.agreement import describe_error, run_everywhere
from fullshard.checkpoint.checksum import file_checksum, save_with_checksum
from fullshard.checkpoint.errors import CheckpointBusyError
from fullshard.checkpoint.folder import check_sizes, folder_to_load
from fullshard.checkpoint.manifest import MANIFEST_FORMAT, MANIFEST_VERSION, FileRecord, write_json_durably
from fullshard.checkpoint.names import (
    CHECKPOINT_MANIFEST,
    FOLDER_MARKER,
    PREVIOUS_SUFFIX,
    STAGING_SUFFIX,
    STAGING_TAG,
    is_staging_name,
    previous_folder,
    staging_folder,
)
from fullshard.checkpoint.writer import write_sharded
from fullshard.ranks import gather_from_ranks, rank_and_world

__all__ = [
    "PREVIOUS_SUFFIX",
    "STAGING_TAG",
    "CheckpointBusyError",
    "SaveTransaction",
    "StagingOwner",
    "claim_staging",
    "folder_to_load",
    "fsync_dir",
    "previous_folder",
    "read_owner",
    "release_staging",
    "staging_folder",
]


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


@dataclass(frozen=True)
class StagingOwner:
    """Who writes a staging folder, from its :data:`STAGING_TAG` (``host`` is None for a tag that names no one)."""

    host: str | None
    pid: int | None
    start: str | None
    save_id: str
    since: float | None

    def describe(self) -> str:
        if self.host is None or self.pid is None:
            return "a job that did not record itself (an older fullshard)"
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(self.since)) if self.since else ""
        return f"another job (host {self.host}, pid {self.pid}{when})"


# save_ids this process is staging now: its own pid in a tag is the owner only while the save runs.
_ACTIVE: set[str] = set()


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, from /proc), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def read_owner(staging: Path) -> StagingOwner | None:
    """The owner recorded in ``staging``'s tag; None when there is no tag (yet)."""
    try:
        text = (staging / STAGING_TAG).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return StagingOwner(None, None, None, "", None)
    try:
        raw = json.loads(text)
        return StagingOwner(str(raw["host"]), int(raw["pid"]), raw.get("start"), str(raw["save_id"]), raw.get("since"))
    except (ValueError, KeyError, TypeError):  # fullshard before owners were recorded wrote the save_id alone
        return StagingOwner(None, None, None, text.strip(), None)


def _owner_is_gone(owner: StagingOwner) -> bool:
    """Whether ``owner`` provably no longer writes its staging folder. See [Note: one job per checkpoint folder]."""
    if owner.host is None or owner.pid is None or owner.host != socket.gethostname():
        return False  # another host's processes cannot be seen from here: keep its folder
    if owner.pid == os.getpid():
        return owner.save_id not in _ACTIVE
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, under another user
        pass
    start = _process_start(owner.pid)
    return owner.start is not None and start is not None and start != owner.start  # the pid was reused


def _wait_for_owner(staging: Path, patience_s: float = 2.0) -> StagingOwner | None:
    # A job that has just created the folder writes its tag right after: give it a moment.
    deadline = time.monotonic() + patience_s
    while (owner := read_owner(staging)) is None and staging.is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    return owner


def _remove_abandoned(staging: Path, owner: StagingOwner) -> None:
    """Delete ``staging`` if it is still ``owner``'s: renamed aside first, so a folder that another job claimed
    meanwhile is put back instead of deleted."""
    aside = staging.with_name(f"{staging.name[: -len(STAGING_SUFFIX)]}.removed-{uuid.uuid4().hex[:8]}{STAGING_SUFFIX}")
    try:
        os.rename(staging, aside)
    except FileNotFoundError:
        return  # someone else removed it
    moved = read_owner(aside)
    if moved is None or moved.save_id != owner.save_id:
        with contextlib.suppress(OSError):  # claimed again meanwhile: put it back
            os.rename(aside, staging)
        return
    shutil.rmtree(aside, ignore_errors=True)


def _remove_abandoned_siblings(parent: Path, keep: Path) -> None:
    if not parent.is_dir():
        return
    for path in parent.iterdir():
        if path == keep or not is_staging_name(path) or not path.is_dir():
            continue
        owner = read_owner(path)
        if owner is not None and _owner_is_gone(owner):
            _remove_abandoned(path, owner)


def _busy(target: Path, staging: Path, owner: StagingOwner | None) -> CheckpointBusyError:
    who = owner.describe() if owner is not None else "a job that has not recorded itself"
    return CheckpointBusyError(
        f"'{target}' is being saved by {who}: its staging folder '{staging}' is in use, so this save stopped "
        "before writing or deleting anything. Wait for that job to finish, or save to another folder. If no job "
        f"writes it any more, delete '{staging}' (fullshard deletes it itself only when its owner is a dead "
        "process on this host)."
    )


def claim_staging(target: Path) -> str:
    """Create ``target``'s staging folder for this process, exclusively; returns the new ``save_id``.

    Deletes abandoned staging folders beside ``target`` (its own included); raises :class:`CheckpointBusyError`
    when another job owns it. See [Note: one job per checkpoint folder].
    """
    staging = staging_folder(target)
    _remove_abandoned_siblings(target.parent, keep=staging)
    target.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        try:
            os.mkdir(staging)
        except FileExistsError:
            owner = _wait_for_owner(staging)
            if owner is None or not _owner_is_gone(owner):
                raise _busy(target, staging, owner) from None
            _remove_abandoned(staging, owner)
            continue
        save_id = uuid.uuid4().hex
        _ACTIVE.add(save_id)
        tag = {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid()),
               "save_id": save_id, "since": time.time()}  # fmt: skip
        try:
            write_json_durably(staging / STAGING_TAG, tag)
        except BaseException:
            release_staging(save_id)
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return save_id
    raise _busy(target, staging, read_owner(staging))


def release_staging(save_id: str) -> None:
    """This process no longer writes the staging folder of ``save_id`` (committed, failed or given up)."""
    _ACTIVE.discard(save_id)


class SaveTransaction:
    """Stages one checkpoint folder on every rank and commits it whole. See [Note: whole-checkpoint commit].

    ``sharded_folder``: the target is one sharded (DCP) folder (``save_sharded``), whose completion marker the
    commit writes at its top, with no manifest; otherwise a ``save_state`` folder, whose sharded subfolders
    get a marker each and which gets the manifest.
    """

    def __init__(
        self,
        target: str | os.PathLike[str],
        where: str,
        process_group: dist.ProcessGroup | None = None,
        *,
        sharded_folder: bool = False,
    ):
        self.target = Path(target)
        self.sharded_folder = sharded_folder
        self.staging = staging_folder(self.target)
        self.where = where
        self.process_group = process_group
        self.rank, self.world = rank_and_world(process_group)
        self.save_id = ""
        self.records: dict[str, FileRecord] = {}  # this rank's files, relative to the staging folder
        self.written = 0  # bytes of this rank's files so far

    # --- steps --------------------------------------------------------------------------------------

    def begin(self) -> None:
        """Claim the staging folder, clean up after killed saves (a collective). Raises
        :class:`CheckpointBusyError` on every rank when another job is saving to the same folder."""
        found, error, failed = run_everywhere(self._prepare if self.rank == 0 else lambda: None, self.process_group)
        if failed:  # every rank is here: the busy case keeps its documented class on every rank
            busy = any(gather_from_ranks(isinstance(error, CheckpointBusyError), self.process_group))
            self._raise("preparing the staging folder", failed, cleanup=False,
                        error_type=CheckpointBusyError if busy else RuntimeError)  # fmt: skip
        ids: list[Any] = [found]
        if self.world > 1:
            dist.broadcast_object_list(ids, src=dist.get_global_rank(self.process_group, 0)
                                       if self.process_group is not None else 0)  # fmt: skip
        self.save_id = ids[0]

    def step(self, what: str, fn: Callable[[], Any], nbytes: int | None = None) -> Any:
        """Run ``fn`` on every rank; if it failed anywhere, every rank raises and the staging folder goes.

        ``nbytes``: about how many bytes ``fn`` writes on this rank (named, with the bytes free, if the disk fills).
        """

        def describe(exc: BaseException) -> str:
            needed = self.written + (nbytes or 0)
            note = " for this rank's files up to this step"
            return describe_error(exc, needed=needed, staging=self.staging, needed_note=note)

        try:
            result, _, failed = run_everywhere(fn, self.process_group, describe)
        except BaseException:  # a peer is gone (the gather failed): this save is over
            release_staging(self.save_id)
            raise
        if failed:
            self._raise(what, failed, cleanup=True)
        return result

    def record(self, relative: str, record: FileRecord) -> None:
        self.records[relative] = record
        self.written += record.size

    def write_sharded(self, part: str, state: dict[str, Any]) -> None:
        """Write ``state`` with DCP into the sharded subfolder ``part`` of the staging folder (``""``: the staging
        folder itself, a one-folder transaction) and record this rank's files. A collective: call it in a step."""
        folder = self.staging / part if part else self.staging
        for leaf, record in write_sharded(state, folder, process_group=self.process_group).items():
            self.record(f"{part}/{leaf}" if part else leaf, record)

    def write_file(self, name: str, obj: Any) -> None:
        """``torch.save(obj)`` into the file ``name`` of the staging folder, checksummed, and record it."""
        self.record(name, save_with_checksum(obj, self.staging / name))

    def commit(self) -> Path:
        """Write the markers and the manifest, then rename the staging folder into place (a collective)."""
        merged: dict[str, FileRecord] = {}
        for records in gather_from_ranks(self.records, self.process_group):
            merged.update(records)
        self.step("committing", lambda: self._commit(merged) if self.rank == 0 else None)
        release_staging(self.save_id)
        return self.target

    # --- rank 0 -------------------------------------------------------------------------------------

    def _prepare(self) -> str:
        save_id = claim_staging(self.target)
        try:
            previous = previous_folder(self.target)
            if previous.is_dir():
                if self.target.exists():
                    shutil.rmtree(previous, ignore_errors=True)
                else:  # a commit was killed between its two renames: the previous checkpoint is whole there
                    os.replace(previous, self.target)
        except BaseException:
            release_staging(save_id)
            shutil.rmtree(self.staging, ignore_errors=True)
            raise
        return save_id

    def _commit(self, files: dict[str, FileRecord]) -> None:
        check_sizes(self.staging, files, "the records of this save")
        if self.sharded_folder:
            write_json_durably(self.staging / FOLDER_MARKER, self._payload(files, items=True))
        else:
            self._write_markers_and_manifest(files)
        fsync_dir(self.staging)
        previous = previous_folder(self.target)
        if self.target.exists():
            os.replace(self.target, previous)
        os.replace(self.staging, self.target)  # releases the lock on target: see [Note: one job per ...]
        (self.target / STAGING_TAG).unlink(missing_ok=True)
        shutil.rmtree(previous, ignore_errors=True)  # a next save to target may be removing it too
        fsync_dir(self.target.parent)

    def _others(self, files: dict[str, FileRecord]) -> dict[str, FileRecord]:
        """The files that the caller's own code (the ``save_state`` pre-hooks) wrote into the staging folder, outside
        the recorded sharded subfolders: committed with the checkpoint, so recorded in its manifest too."""
        parts = {name.split("/", 1)[0] for name in files if "/" in name}
        found = {}
        for path in sorted(self.staging.rglob("*")):
            name = path.relative_to(self.staging).as_posix()
            if name in files or name == STAGING_TAG or name.split("/", 1)[0] in parts:
                continue
            if path.is_file() and not path.is_symlink():
                found[name] = file_checksum(path)
        return found

    def _write_markers_and_manifest(self, files: dict[str, FileRecord]) -> None:
        by_folder: dict[str, dict[str, FileRecord]] = {}
        for name, record in files.items():
            folder, _, leaf = name.rpartition("/")
            if folder:
                by_folder.setdefault(folder, {})[leaf] = record
        listed = {**self._others(files), **files}
        for folder, members in sorted(by_folder.items()):
            marker = self.staging / folder / FOLDER_MARKER
            write_json_durably(marker, self._payload(members, items=True))
            listed[f"{folder}/{FOLDER_MARKER}"] = file_checksum(marker)
        write_json_durably(self.staging / CHECKPOINT_MANIFEST, self._payload(listed, items=False))

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

    def _raise(
        self, what: str, failed: dict[int, str], *, cleanup: bool, error_type: type[RuntimeError] = RuntimeError
    ) -> None:
        removed = ""
        release_staging(self.save_id)
        if cleanup and self.rank == 0:
            shutil.rmtree(self.staging, ignore_errors=True)
        if cleanup:
            removed = " The partial save was removed."
        reasons = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failed.items()))
        raise error_type(
            f"{self.where}: {what} failed on rank(s) {sorted(failed)} ({reasons}). The checkpoint at "
            f"'{self.target}' is unchanged.{removed}"
        )

"""What a checkpoint folder is, decided in one place: missing, staging, previous-only, incomplete or complete.

[Note: what a folder is]
A save to ``dir`` (``save_state`` or ``save_sharded``: one protocol, [Note: whole-checkpoint commit] in
``transaction.py``) leaves ``dir`` in one of these states (:class:`FolderState`, :func:`checkpoint_state`):

- ``MISSING``: nothing is there, and no whole previous version either.
- ``PREVIOUS_ONLY``: nothing is there, but ``dir.previous`` holds the whole previous checkpoint (a commit was
  killed between its two renames). ``load_state(dir)`` loads it from there (:func:`folder_to_load`), and the
  next save to ``dir`` puts it back.
- ``STAGING``: ``dir`` is itself a staging folder (``*.incomplete``): a save that has not committed, never a
  checkpoint, whatever it holds. Every load, merge and verify refuses it with :func:`staging_error`.
- ``INCOMPLETE``: a folder (or a file) that is not a whole checkpoint.
- ``COMPLETE``: with a manifest, every file it lists is there with its recorded size (checksums are left to
  ``verify``); without one (Accelerate, fullshard before the manifest), it holds ``random_states_0.pkl``
  (written near the end of such a save) and every sharded subfolder holding data files also holds
  ``.metadata`` (which torch writes last).

[Note: one rule for every reader]
A sharded subfolder of a ``save_state`` checkpoint (``ck/pytorch_model_fsdp_0``, ``ck/optimizer_0``) is read
by ``load_state(ck)``, and alone by ``load_sharded``, ``merge_fsdp_weights`` and ``verify`` given the subfolder.
Each of them runs :func:`check_part` on it first (the loads of ``ck`` through ``verify.check_parts``, a
subfolder given alone through :func:`check_enclosing`), so the same folder is refused by all of them or by
none: the subfolder is not a symbolic link (even when it is the folder named); with the checkpoint's manifest,
every file the manifest lists under it is there with its recorded size, nothing else is, its marker has the
CRC-32 the manifest records (the marker holds the checksums of everything else in the subfolder) and the
manifest's save id. A checkpoint that fullshard wrote (a subfolder's marker carries a save id, which only a
save that also writes the manifest records in a checkpoint) cannot be taken for an unchecked one by deleting
records: without its manifest it is refused, naming the markers that show it. A sharded folder read alone counts
as a part of a checkpoint when its parent holds a manifest or ``random_states_0.pkl`` (``save_state`` writes
both); otherwise it is a folder of its own (``save_sharded``'s), whose marker is its only record.

"This file has its recorded size" is one check too (:func:`size_problem`), run by the commit before it renames,
by the loads and by ``verify``. One sharded folder loaded alone (``load_sharded``, ``merge_fsdp_weights``) is
complete when it has ``.metadata`` and its marker's sizes hold (``reader.resolve_checkpoint_dir``, on top of
the states here).
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

from fullshard.checkpoint.boundary import entry_path
from fullshard.checkpoint.checksum import file_checksum
from fullshard.checkpoint.errors import CheckpointDamagedError
from fullshard.checkpoint.manifest import FileRecord, Manifest, read_folder_marker, read_manifest
from fullshard.checkpoint.names import (
    CHECKPOINT_MANIFEST,
    DCP_METADATA_FILE,
    FOLDER_MARKER,
    PREVIOUS_SUFFIX,
    STAGING_SUFFIX,
    is_load_state_part,
    is_staging_name,
    previous_folder,
    rng_state_file_name,
    staging_folder,
)

__all__ = [
    "FolderState",
    "check_enclosing",
    "check_output_dir",
    "check_part",
    "check_sizes",
    "checkpoint_state",
    "folder_to_load",
    "is_complete_checkpoint",
    "missing_hint",
    "missing_message",
    "size_problem",
    "staging_error",
]


class FolderState(enum.Enum):
    """What a checkpoint folder is. See [Note: what a folder is]."""

    MISSING = "missing"
    PREVIOUS_ONLY = "previous-only"
    STAGING = "staging"
    INCOMPLETE = "incomplete"
    COMPLETE = "complete"


def missing_message(path: Path) -> str:
    """What every check says of a part of a checkpoint that is not there."""
    return f"{path} is missing: the checkpoint in {path.parent} is incomplete; re-save it."


def size_problem(path: Path, record: FileRecord, listed_in: str) -> CheckpointDamagedError | None:
    """The error for ``path`` if it is missing or not the size ``listed_in`` (a manifest or marker) records."""
    if not path.is_file():
        return CheckpointDamagedError(missing_message(path))
    size = path.stat().st_size
    if size == record.size:
        return None
    return CheckpointDamagedError(
        f"{path} is {size} bytes, but {listed_in} records {record.size}: it was truncated, damaged or replaced by "
        "a file from another save. Load another checkpoint or re-save."
    )


def check_sizes(root: Path, files: dict[str, FileRecord], listed_in: str) -> None:
    """Raise :class:`CheckpointDamagedError` for the first of ``files`` (sorted; relative to ``root``) that is
    missing or not its recorded size. The names were resolved inside ``root`` when the record was read."""
    for name, record in sorted(files.items()):
        problem = size_problem(root / name, record, listed_in)
        if problem is not None:
            raise problem


def _sizes_hold(root: Path, files: dict[str, FileRecord]) -> bool:
    return all(size_problem(root / name, record, "") is None for name, record in files.items())


def _is_whole(root: Path) -> bool:
    """Whether the existing folder ``root`` is a whole ``save_state`` checkpoint; never raises for damage."""
    try:
        manifest = read_manifest(root)
    except (RuntimeError, ValueError):  # a corrupt manifest, or one naming a file outside the folder
        return False
    if manifest is not None:
        return _sizes_hold(root, manifest.files)
    if not (root / rng_state_file_name(0)).is_file():
        return False
    for sub in root.iterdir():
        if sub.is_dir() and any(sub.glob("*.distcp")) and not (sub / DCP_METADATA_FILE).is_file():
            return False
    return True


def checkpoint_state(folder: str | os.PathLike[str]) -> FolderState:
    """What ``folder`` is, as a ``save_state`` checkpoint. See [Note: what a folder is]."""
    root = Path(folder)
    if not root.exists():
        previous = previous_folder(root)
        return FolderState.PREVIOUS_ONLY if previous.is_dir() and _is_whole(previous) else FolderState.MISSING
    if is_staging_name(root):
        return FolderState.STAGING
    if root.is_dir() and _is_whole(root):
        return FolderState.COMPLETE
    return FolderState.INCOMPLETE


def is_complete_checkpoint(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` is a whole ``save_state`` checkpoint that ``load_state`` may take (never raises)."""
    return checkpoint_state(folder) is FolderState.COMPLETE


def folder_to_load(folder: Path) -> Path:
    """The folder ``load_state(folder)`` reads: ``folder``, or ``folder.previous`` when ``folder`` is missing and
    the previous checkpoint is whole there (a commit was killed between its two renames)."""
    return previous_folder(folder) if checkpoint_state(folder) is FolderState.PREVIOUS_ONLY else folder


def staging_error(folder: Path, where: str = "") -> CheckpointDamagedError:
    """The one refusal of a staging folder, by every load, merge and verify (``where``: the call, or empty)."""
    return CheckpointDamagedError(
        f"{where}{': ' if where else ''}'{folder}' is the staging folder of a save that never finished (its name "
        f"ends in {STAGING_SUFFIX!r}): the checkpoint is incomplete, it is not a checkpoint to load. Load the "
        "folder without the suffix, or an earlier checkpoint."
    )


def missing_hint(folder: Path) -> str:
    """For a missing ``folder``: what a save left beside it (its previous version, or an unfinished staging one)."""
    previous, staged = previous_folder(folder), staging_folder(folder)
    if previous.is_dir():
        return f" A save was interrupted while replacing it; the previous checkpoint is at '{previous}'."
    if staged.is_dir():
        return f" '{staged}' exists, but that save never finished (the checkpoint is incomplete)."
    return ""


def check_output_dir(output_dir: object, where: str) -> Path:
    """``output_dir`` as a Path, if a save may write there: a path (not a file) whose name is not reserved."""
    if not isinstance(output_dir, str | os.PathLike):
        raise ValueError(f"{where}: expected a folder path (str or Path), got {output_dir!r}.")
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{where}: a file is in the way at '{out}'; pass a folder path, or move the file.")
    if out.name.endswith((STAGING_SUFFIX, PREVIOUS_SUFFIX)):
        raise ValueError(
            f"{where}: folder names ending in {STAGING_SUFFIX!r} or {PREVIOUS_SUFFIX!r} are reserved for staging; "
            "pick another name."
        )
    return out


# --- the sharded subfolders of a save_state checkpoint: see [Note: one rule for every reader] ---------------------


def _marked_parts(root: Path) -> list[str]:
    """The subfolders of ``root`` that ``load_state`` reads and whose marker carries a save id."""
    found = []
    for sub in sorted(root.iterdir()):
        if sub.is_dir() and not sub.is_symlink() and is_load_state_part(sub.name):
            marker = read_folder_marker(sub)
            if marker is not None and marker.save_id is not None:
                found.append(sub.name)
    return found


def _missing_manifest(root: Path) -> CheckpointDamagedError:
    parts = ", ".join(f"'{name}'" for name in _marked_parts(root))
    return CheckpointDamagedError(
        f"{root / CHECKPOINT_MANIFEST} is missing, but fullshard wrote this checkpoint ({parts} carry the save's "
        "markers): without its manifest it cannot be checked, and it is not loaded unchecked. Load another "
        "checkpoint, or re-save."
    )


def check_part(root: Path, name: str, manifest: Manifest | None) -> Path:
    """The sharded subfolder ``name`` of the ``save_state`` checkpoint ``root``, checked as every reader checks it
    before reading any of it (``manifest``: ``root``'s); returns its path. See [Note: one rule for every reader]."""
    sub = entry_path(root, name)  # a subfolder that is a link is refused, not followed
    if manifest is None:
        if _marked_parts(root):
            raise _missing_manifest(root)
        return sub
    prefix = f"{name}/"
    listed = {key[len(prefix) :]: record for key, record in manifest.files.items() if key.startswith(prefix)}
    marker = listed.get(FOLDER_MARKER)
    if marker is None:
        raise CheckpointDamagedError(
            f"{sub} is not part of save {manifest.save_id} ({manifest.path} lists no {FOLDER_MARKER} for it): it "
            "comes from another save. Remove it, or load another checkpoint."
        )
    own = read_folder_marker(sub)  # first: a folder copied in from another save is named as such
    if own is not None and own.save_id != manifest.save_id:
        raise CheckpointDamagedError(
            f"{root}: its parts come from different saves: '{name}' is from save {own.save_id}, the checkpoint "
            f"({CHECKPOINT_MANIFEST}) from save {manifest.save_id}. Load another checkpoint, or re-save."
        )
    check_sizes(sub, listed, f"{manifest.path.name} of {root}")
    for path in sorted(sub.iterdir()):
        if path.name not in listed:
            raise CheckpointDamagedError(
                f"{path} is not part of save {manifest.save_id} ({manifest.path} does not list it): it comes from "
                "another save. Remove it, or load another checkpoint."
            )
    actual = file_checksum(sub / FOLDER_MARKER)  # small: it holds the checksums of everything else in the folder
    if marker.crc32 is not None and actual.crc32 != marker.crc32:
        raise CheckpointDamagedError(
            f"{sub / FOLDER_MARKER} is corrupt: its CRC-32 is {actual.crc32:08x}, but {manifest.path} records "
            f"{marker.crc32:08x}. Load another checkpoint, or re-save."
        )
    return sub


def check_enclosing(folder: Path) -> None:
    """A sharded folder read alone (``load_sharded``, ``merge``, ``verify`` of it): if it is a part of a
    ``save_state`` checkpoint, the checks every load of that checkpoint runs on it (:func:`check_part`)."""
    folder = Path(os.path.abspath(folder))
    root = folder.parent
    if not is_load_state_part(folder.name) or root == folder:
        return
    manifest = read_manifest(root)
    if manifest is None and not (root / rng_state_file_name(0)).is_file():
        return  # not inside a save_state checkpoint (which writes both): a folder of its own, e.g. save_sharded's
    check_part(root, folder.name, manifest)

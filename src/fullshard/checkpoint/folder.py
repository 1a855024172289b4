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

"This file has its recorded size" is one check too (:func:`size_problem`), run by the commit before it renames,
by the loads and by ``verify``. One sharded folder loaded alone (``load_sharded``, ``merge_fsdp_weights``) is
complete when it has ``.metadata`` and its marker's sizes hold (``reader.resolve_checkpoint_dir``, on top of
the states here).
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

from fullshard.checkpoint.errors import CheckpointDamagedError
from fullshard.checkpoint.manifest import FileRecord, read_manifest
from fullshard.checkpoint.names import (
    DCP_METADATA_FILE,
    PREVIOUS_SUFFIX,
    STAGING_SUFFIX,
    is_staging_name,
    previous_folder,
    rng_state_file_name,
    staging_folder,
)

__all__ = [
    "FolderState",
    "check_output_dir",
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

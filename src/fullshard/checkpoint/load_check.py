"""Before a ``load_state`` modifies anything: which folder it reads, that folder checked, its small files read.

Each is one call, run on every rank (a collective) and raising the same error on every rank:

- :func:`folder_for_load`: the folder named, or its whole previous version when a save was killed between the
  two renames of its commit (with a warning); a staging folder or a missing one is refused.
- :func:`check_before_loading`: the parts are those of one save (:func:`~fullshard.checkpoint.verify.
  check_parts`), every name is inside the folder ([Note: a checkpoint folder is a boundary]), every file the
  load needs is there, and each file it reads whole has its recorded CRC-32 (``verify``: every file of the
  checkpoint, the ranks sharing the reading). A folder that records no checksums (Accelerate's) loads with a
  warning.
- :func:`read_on_every_rank`: the small files, read without unpickling arbitrary objects, before anything is
  loaded; a refusal on any rank raises on every rank.

The caller says which files it needs (a training folder's layout is the front end's); this module says how
they are checked.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from fullshard.checkpoint.agreement import run_everywhere
from fullshard.checkpoint.boundary import entry_path
from fullshard.checkpoint.errors import CheckpointDamagedError, CheckpointFileError
from fullshard.checkpoint.folder import FolderState, checkpoint_state, staging_error
from fullshard.checkpoint.names import CHECKPOINT_MANIFEST, previous_folder, staging_folder
from fullshard.checkpoint.verify import check_file, check_parts, verify_checkpoint
from fullshard.ranks import gather_from_ranks

__all__ = ["check_before_loading", "folder_for_load", "read_on_every_rank"]

_T = TypeVar("_T")


def folder_for_load(input_dir: str | Path, where: str) -> Path:
    """``input_dir``, or its whole previous version if a save was killed while replacing it (with a warning)."""
    folder = Path(input_dir)
    state = checkpoint_state(folder)
    if state is FolderState.STAGING:
        raise staging_error(folder, where)
    if state is FolderState.PREVIOUS_ONLY:
        previous = previous_folder(folder)
        if dist.get_rank() == 0:
            warnings.warn(
                f"{where}: the folder is missing because a save was killed while replacing it; loading the whole "
                f"previous checkpoint from '{previous}' (the next save_state to '{folder}' puts it back).",
                stacklevel=4,
            )
        return previous
    if not folder.is_dir():
        staged = " (a save to it never finished)" if staging_folder(folder).is_dir() else ""
        raise FileNotFoundError(f"{where}: '{folder}' does not exist{staged}; pass the folder save_state wrote.")
    return folder


def _check_here(
    folder: Path, needed: Sequence[str], whole: Sequence[str], own: Sequence[str], verify: bool, hint: str, where: str
) -> tuple[str | None, Any]:
    """This rank's checks: (the problem, or None; the manifest)."""
    manifest = None
    try:
        manifest = check_parts(folder)
        for name in [*needed, *own]:
            entry_path(folder, name)  # no link, before anything is read; see checkpoint/boundary.py
        for name in needed:
            if not (folder / name).exists():
                raise FileNotFoundError(f"{where}: '{folder / name}' is missing. {hint}")
        if verify:
            rank, world = dist.get_rank(), dist.get_world_size()
            verify_checkpoint(folder, share=(rank, world))
        else:  # the files this rank reads whole; sharded folders are checked item by item as they load
            for name in [*whole, *(name for name in own if (folder / name).is_file())]:
                check_file(folder / name, manifest)
    except (FileNotFoundError, RuntimeError, ValueError) as exc:
        return str(exc), manifest
    return None, manifest


def check_before_loading(
    folder: Path,
    needed: Sequence[str],
    whole: Sequence[str],
    own: Sequence[str],
    *,
    verify: bool,
    where: str,
    hint: str = "",
) -> list[list[bool]]:
    """Check ``folder`` on every rank before a load reads it; raise the same error on every rank (a collective).

    ``needed``: the files and sharded subfolders every rank needs (a missing one raises ``FileNotFoundError``
    with ``hint``); ``whole``: those this rank reads whole (their CRC-32 is checked); ``own``: this rank's own
    files, which may be absent (checked and read whole when present). Returns, for every rank, which of its
    ``own`` files are there.
    """
    problem, manifest = _check_here(folder, needed, whole, own, verify, hint, where)
    everyone = gather_from_ranks((problem, [(folder / name).is_file() for name in own]))
    first = next((p for p, _ in everyone if p), None)
    if first:
        raise (FileNotFoundError if " is missing" in first else CheckpointDamagedError)(first)
    if manifest is None and dist.get_rank() == 0:  # check_parts refused a fullshard checkpoint without one
        warnings.warn(
            f"{where}: this checkpoint has no {CHECKPOINT_MANIFEST} (written by Accelerate or a fullshard before "
            "2026-11-23), so it records no checksums: it loads with its DCP metadata checked, its bytes unchecked.",
            stacklevel=4,
        )
    return [present for _, present in everyone]


def read_on_every_rank(read: Callable[[], _T]) -> _T:
    """``read()`` (safe reads of small files) on every rank; if it failed on any rank, every rank raises
    :class:`CheckpointFileError`: its own message when it failed (it names the file), else the first failing
    rank's. A collective."""
    result, error, failed = run_everywhere(read)
    if failed:
        raise CheckpointFileError(str(error) if error is not None else failed[min(failed)])
    return result

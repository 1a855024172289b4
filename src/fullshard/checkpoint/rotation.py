"""Automatic checkpoint naming, as Accelerate's ``ProjectConfiguration(automatic_checkpoint_naming=True)`` does.

``save_state()`` with no folder writes ``<project_dir>/checkpoints/checkpoint_<iteration>``; the iteration
counts saves (``ProjectConfiguration.iteration``, +1 after each save). Unlike Accelerate, which deletes the
oldest folders *before* saving (so a failed save can leave fewer checkpoints than ``total_limit``, or none),
:func:`prune_checkpoints` runs only after the new checkpoint is complete, and only complete checkpoints are
counted, kept, or returned by :func:`latest_checkpoint`; partial saves are never the latest.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from fullshard.checkpoint.folder import is_complete_checkpoint

__all__ = [
    "CHECKPOINTS_FOLDER",
    "checkpoint_folder",
    "checkpoint_index",
    "complete_checkpoints",
    "latest_checkpoint",
    "prune_checkpoints",
]

CHECKPOINTS_FOLDER = "checkpoints"
_NAME_RE = re.compile(r"^checkpoint_(\d+)$")


def checkpoint_folder(project_dir: str | os.PathLike[str], iteration: int) -> Path:
    """``<project_dir>/checkpoints/checkpoint_<iteration>``."""
    return Path(project_dir) / CHECKPOINTS_FOLDER / f"checkpoint_{iteration}"


def checkpoint_index(folder: str | os.PathLike[str]) -> int | None:
    """The ``<i>`` of a ``checkpoint_<i>`` folder name (``None`` for other names)."""
    match = _NAME_RE.match(Path(folder).name)
    return int(match.group(1)) if match else None


def _checkpoints_dir(path: str | os.PathLike[str]) -> Path:
    # Accept the project folder or its checkpoints/ folder, whichever the caller has at hand.
    path = Path(path)
    return path / CHECKPOINTS_FOLDER if (path / CHECKPOINTS_FOLDER).is_dir() else path


def complete_checkpoints(path: str | os.PathLike[str]) -> list[Path]:
    """The complete ``checkpoint_<i>`` folders under ``path`` (a project dir or its ``checkpoints/``), oldest first."""
    root = _checkpoints_dir(path)
    if not root.is_dir():
        return []
    found = [(checkpoint_index(p), p) for p in root.iterdir() if checkpoint_index(p) is not None]
    return [p for i, p in sorted(found, key=lambda t: t[0] or 0) if is_complete_checkpoint(p)]


def latest_checkpoint(path: str | os.PathLike[str]) -> Path | None:
    """The newest *complete* ``checkpoint_<i>`` folder under ``path``, or ``None`` if there is none.

    ``path`` is the project folder (``ProjectConfiguration.project_dir``) or its ``checkpoints/`` folder.
    A save that was killed or failed leaves no complete folder, so it is never returned.
    """
    done = complete_checkpoints(path)
    return done[-1] if done else None


def prune_checkpoints(path: str | os.PathLike[str], total_limit: int | None, keep: Path) -> list[Path]:
    """Delete the oldest complete checkpoints so that at most ``total_limit`` remain; never deletes ``keep``.

    Called after ``keep`` (the checkpoint just written) is complete. Returns the deleted folders.
    """
    if total_limit is None:
        return []
    done = [p for p in complete_checkpoints(path) if p != keep]
    excess = len(done) + 1 - max(total_limit, 1)
    deleted = done[: max(excess, 0)]
    for folder in deleted:
        shutil.rmtree(folder, ignore_errors=True)
    return deleted

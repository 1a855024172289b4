"""The trust boundary of a checkpoint folder: which files a load, merge or verify may open.

[Note: a checkpoint folder is a boundary]
A checkpoint names the files it is made of in three places: DCP's ``.metadata`` (every stored item's
``relative_path``), the folder markers and the manifest (``files``), and the fixed names ``load_state``
reads (``scheduler.bin``, ``pytorch_model_fsdp_0/``, ...). A crafted or damaged checkpoint could name
``../../elsewhere/x.distcp``, ``/etc/passwd``, or hold a symbolic link to either, and a load would read
another file's bytes as its tensors. So every such name goes through :func:`entry_path` before the file is
opened or even stat'ed: it must be a relative path of plain names (not absolute, no ``..``, not empty), and
no part of it below the folder may be a symbolic link, even one that points back inside (fullshard never
writes links, so one is foreign). Anything else raises :class:`CheckpointDamagedError` naming the entry,
where it was listed and what is wrong, and nothing about the file it points at (whether it exists, its
size) is revealed. The folder passed in may itself be a link or lie under one: the boundary is the folder
it resolves to.

What is *not* detected: a ``.metadata`` and a marker rewritten consistently with each other (the checksums
find damage, they do not authenticate a checkpoint; see ``docs/checkpoints.md``, "The trust boundary").
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from fullshard.checkpoint.errors import CheckpointDamagedError

__all__ = ["CheckpointDamagedError", "entry_path"]


def _why_outside(folder: Path, name: object) -> tuple[str, Path | None]:
    """What is wrong with ``name`` as the name of a file inside ``folder`` (``""`` if nothing), and its path."""
    if not isinstance(name, str) or not name or "\0" in name:
        return "is not a file name", None
    relative = PurePosixPath(name)
    if relative.is_absolute():
        return "is an absolute path", None
    if ".." in relative.parts:
        return "leads out of the folder ('..')", None
    if not relative.parts:
        return "names no file", None
    path = folder.joinpath(*relative.parts)
    inside = os.path.join(os.path.realpath(folder), *relative.parts)
    if os.path.realpath(path) != inside:
        return "is a symbolic link or lies under one", None
    return "", path


def entry_path(folder: str | os.PathLike[str], name: object, *, listed_in: str | None = None) -> Path:
    """The path of the file ``name`` (a relative POSIX path) inside the checkpoint folder ``folder``.

    Raises :class:`CheckpointDamagedError` if ``name`` is absolute, leads out with ``..``, is not a string, or
    if it or a folder on its way is a symbolic link; ``listed_in`` (``".metadata"``, a marker's name) says
    where the name came from. Reads no byte of the file. See [Note: a checkpoint folder is a boundary].
    """
    root = Path(folder)
    why, path = _why_outside(root, name)
    if path is not None:
        return path
    where = f"the entry {name!r} of {listed_in}" if listed_in else repr(name)
    raise CheckpointDamagedError(
        f"{root}: {where} {why}. A checkpoint may only name files inside its own folder (relative paths, no "
        "'..', no symbolic links), so fullshard did not open it; the checkpoint is crafted or damaged. "
        "Load another checkpoint."
    )

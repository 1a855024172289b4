"""How checkpoint and export files are created, and how a failed write is described (the bottom of the package).

[Note: exclusive creation]
Every file fullshard writes (checkpoint parts, manifests, markers, merged and exported weights) is created
anew with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (:func:`create_exclusive`): an existing file or symbolic link at
that name is never opened, so a link planted at a temporary name (``OUT/.model.safetensors.partial`` ->
``~/.bashrc``) is neither followed nor overwritten. Outputs that replace an earlier version are written under
a temporary name unique to this write (:func:`temporary_name`: ``.<name>.<random>.partial``) and renamed
over the final name when complete: ``rename`` replaces the directory entry and never follows a link at the
final name, so what a link there points to stays untouched too.

[Note: naming a full disk]
A write that hits ENOSPC does not always raise an ``OSError``: ``torch.save`` into a stream raises
``RuntimeError('[enforce fail at inline_container.cc:...] unexpected pos ...')`` with the ``OSError(28)`` in
its ``__context__``, and DCP wraps each rank's failure in a ``CheckpointException``. :func:`find_os_error`
walks all of these (``failures``, ``__cause__``, ``__context__``) so that the message says "no space left on
device", with the path, the bytes needed and the bytes free (:func:`no_space_message`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "NoSpaceError",
    "create_exclusive",
    "find_os_error",
    "folder_bytes",
    "free_bytes",
    "new_folders",
    "no_space_message",
    "remove_new_folders",
    "temporary_name",
    "with_filename",
    "write_replacing",
]

_EXCLUSIVE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def create_exclusive(path: str | os.PathLike[str]) -> BinaryIO:
    """Open a new file at ``path`` for binary writing; refuse one that exists. See [Note: exclusive creation].

    Raises ``FileExistsError`` naming the path (and a symbolic link's target) when anything is there.
    """
    try:  # open() with this opener keeps the path as the file's name (for error messages)
        return open(path, "wb", opener=lambda name, _: os.open(name, _EXCLUSIVE, 0o666))
    except FileExistsError:
        what = "a file"
        if os.path.islink(path):
            what = f"a symbolic link to '{os.readlink(path)}'"
        raise FileExistsError(
            errno.EEXIST,
            f"{what} is already there; fullshard creates its files anew and never writes through an existing "
            "file or link. Remove it, or write elsewhere",
            str(path),
        ) from None


def temporary_name(final: Path) -> Path:
    """A name beside ``final`` that no other write uses: ``.<final name>.<random>.partial``."""
    return final.with_name(f".{final.name}.{secrets.token_hex(6)}.partial")


def write_replacing(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Create ``path`` whole or not at all: ``write`` fills a new temporary file beside it, which is fsync'd and
    renamed over ``path`` (a link there is replaced, never followed). See [Note: exclusive creation]."""
    tmp = temporary_name(path)
    try:
        with create_exclusive(tmp) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def find_os_error(exc: BaseException) -> OSError | None:
    """The first ``OSError`` with an errno in ``exc``'s chain (DCP failures, ``__cause__``, ``__context__``)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(inner, BaseException):
                    todo.append(inner)
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
    return None


def with_filename(exc: BaseException, path: str | os.PathLike[str]) -> BaseException:
    """``exc``, or, when its chain holds an ``OSError`` without a file name, that error naming ``path``."""
    found = find_os_error(exc)
    if found is None or isinstance(found.filename, str | bytes | os.PathLike):
        return exc
    return OSError(found.errno, found.strerror or os.strerror(found.errno or 0), str(path))


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes free on the file system holding ``path`` (or its nearest existing folder); ``None`` if unknown."""
    try:
        return shutil.disk_usage(_existing(Path(path))).free
    except OSError:
        return None


def folder_bytes(folder: str | os.PathLike[str]) -> int:
    """Bytes of the files under ``folder`` (0 if it is gone)."""
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _mb(n: int) -> str:
    return f"{n} bytes ({n / 1e6:.1f} MB)"


def no_space_message(
    path: str | os.PathLike[str] | None,
    needed: int | None,
    free: int | None,
    *,
    needed_note: str = "",
    free_note: str = "",
) -> str:
    """One line for ENOSPC: the path, the bytes needed and the bytes free. See [Note: naming a full disk]."""
    where = f" writing '{path}'" if path else ""
    need = f"it needs {_mb(needed)}{needed_note}" if needed is not None else "the size it needs is unknown"
    have = f"{_mb(free)} are free there{free_note}" if free is not None else "the free space is unknown"
    return f"no space left on device (ENOSPC){where}: {need}, {have}. Free space, or write elsewhere"


class NoSpaceError(OSError):
    """ENOSPC, said with the path, the bytes needed and the bytes free (:func:`no_space_message`)."""

    def __init__(self, path: str | os.PathLike[str], needed: int | None, free: int | None) -> None:
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        self.message = no_space_message(path, needed, free)

    def __str__(self) -> str:
        return self.message


def new_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first: what a write would create."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_new_folders(folders: list[Path]) -> None:
    """Remove ``folders`` (from :func:`new_folders`), deepest first, each only if it is empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (someone else's files), or already gone
            return

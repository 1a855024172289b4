"""Agreement between ranks for checkpoint steps: every rank learns whether any rank failed, and why.

Each "agree" is an all-gather (of flags or short messages) rather than a barrier: a rank that failed still
answers, so no peer waits forever on it. A rank that died outright makes its peers fail in the gather (the
process group's timeout), which they report as a failure like any other.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fullshard.checkpoint.files import find_os_error, folder_bytes, free_bytes, no_space_message
from fullshard.ranks import gather_from_ranks

__all__ = ["describe_error", "gather_errors", "run_everywhere"]


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost meaningful error: DCP wraps each rank's failure (with a whole traceback as text)."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures:
            first = next(iter(failures.values()))
            inner = first[0] if isinstance(first, tuple) else first
            if isinstance(inner, BaseException):
                exc = inner
                continue
        if exc.__cause__ is not None and not isinstance(exc, OSError):
            exc = exc.__cause__
            continue
        break
    return exc


def describe_error(
    exc: BaseException, *, needed: int | None = None, staging: Path | None = None, needed_note: str = ""
) -> str:
    """One line: what went wrong, with the full disk and read-only cases spelled out.

    For a full disk (found anywhere in ``exc``'s chain, see [Note: naming a full disk] in ``files.py``) the
    line names the file, ``needed`` bytes and the bytes free on that file system, counting the ``staging``
    folder's, which the failed save removes.
    """
    found = find_os_error(exc)
    if found is not None and found.errno == errno.ENOSPC:
        path = found.filename if isinstance(found.filename, str) else staging
        free = free_bytes(path or ".")
        reclaimed = folder_bytes(staging) if staging is not None else 0
        note = " once the partial save is removed" if reclaimed else ""
        return no_space_message(
            path, needed, None if free is None else free + reclaimed, needed_note=needed_note, free_note=note
        )
    if found is not None and found.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"cannot write '{found.filename}' ({found.strerror}); save to a writable folder"
    cause = _root_cause(exc)
    lines = str(cause).strip().splitlines()
    if type(cause).__module__.startswith("fullshard."):  # our messages name the file and the remedy already
        return " ".join(lines)
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


def gather_errors(
    error: BaseException | None,
    process_group: dist.ProcessGroup | None = None,
    describe: Callable[[BaseException], str] = describe_error,
) -> dict[int, str]:
    """Every rank's failure (rank -> one-line description); empty when all succeeded. A collective."""
    mine = None if error is None else describe(error)
    everyone = gather_from_ranks(mine, process_group)
    return {r: msg for r, msg in enumerate(everyone) if msg is not None}


def run_everywhere(
    step: Callable[[], Any],
    process_group: dist.ProcessGroup | None = None,
    describe: Callable[[BaseException], str] = describe_error,
) -> tuple[Any, BaseException | None, dict[int, str]]:
    """Run ``step`` on this rank, then agree: returns (its result, its error, every rank's failure)."""
    result, error = None, None
    try:
        result = step()
    except (Exception, dcp.CheckpointException) as exc:  # CheckpointException is a BaseException
        error = exc
    return result, error, gather_errors(error, process_group, describe)

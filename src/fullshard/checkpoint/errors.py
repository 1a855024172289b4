"""The errors of the checkpoint package (its bottom: every module may raise them, this one imports nothing).

One condition, one type, everywhere: a checkpoint that is missing a part, truncated, corrupt, from another save,
a staging folder, or naming a file outside its folder is :class:`CheckpointDamagedError` (a ``RuntimeError``)
whichever load, merge or verify finds it.
"""

from __future__ import annotations

__all__ = [
    "BackgroundSaveError",
    "CheckpointBusyError",
    "CheckpointDamagedError",
    "CheckpointFileError",
    "NotACheckpointError",
]


class CheckpointDamagedError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt, from another save, or outside its folder; the message
    names it."""


class NotACheckpointError(ValueError):
    """The folder holds no checkpoint (no manifest, no ``.metadata``, no checkpoint files)."""


class CheckpointBusyError(RuntimeError):
    """Another job is saving to the same checkpoint folder; the message names it (host, pid)."""


class CheckpointFileError(RuntimeError):
    """A checkpoint file that cannot be loaded safely; the message names the file and what to do."""


class BackgroundSaveError(RuntimeError):
    """A save started with ``async_save=True`` failed in the background; raised by the next call that waits for
    it. The message is the save's own (the step, the failing ranks, the file); the checkpoint is unchanged."""

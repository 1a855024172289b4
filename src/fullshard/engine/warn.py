"""Warnings from the engine: issued by rank 0 only, so that N ranks do not print the same line N times."""

from __future__ import annotations

import warnings

from fullshard.engine.mesh import global_rank

__all__ = ["warn_rank0"]


def warn_rank0(message: str, stacklevel: int = 2) -> None:
    """``warnings.warn(message)`` on rank 0 (or without a process group); a no-op on other ranks."""
    if global_rank() != 0:
        return
    warnings.warn(message, stacklevel=stacklevel + 1)

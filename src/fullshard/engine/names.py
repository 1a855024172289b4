"""The one name the engine inserts into module paths, and the one function that takes it out again.

A ``FullyShardedDataParallel`` wrapper holds its module as ``_fsdp_wrapped_module`` (torch's name, so that
module paths match torch's FSDP). Every name the engine shows (parameter and buffer names, state-dict and
optimizer-state keys, unit labels, error messages) is cleaned of that segment: it is the unwrapped model's name.
This module imports nothing.
"""

from __future__ import annotations

__all__ = ["WRAPPED_NAME", "clean_key"]

WRAPPED_NAME = "_fsdp_wrapped_module"


def clean_key(key: str) -> str:
    """``key`` (a dotted module path or state-dict key) without any ``_fsdp_wrapped_module`` segment."""
    return ".".join(part for part in key.split(".") if part != WRAPPED_NAME)

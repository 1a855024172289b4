"""The names the engine puts on modules: the one it inserts into module paths, and the one function that takes it
out again; the attribute a unit's state lives under.

A ``FullyShardedDataParallel`` wrapper holds its module as ``_fsdp_wrapped_module`` (torch's name, so that
module paths match torch's FSDP). Every name the engine shows (parameter and buffer names, state-dict and
optimizer-state keys, unit labels, error messages) is cleaned of that segment: it is the unwrapped model's name.
This module imports nothing.
"""

from __future__ import annotations

__all__ = ["STATE_ATTR", "WRAPPED_NAME", "clean_key"]

WRAPPED_NAME = "_fsdp_wrapped_module"

# A unit's state lives in its module's __dict__, under this name. Not in a module-level WeakKeyDictionary: the
# state refers to its module (and its hooks' closures do), so such a dictionary's value would keep its own key
# alive, and no sharded model, its parameters or its optimizer's view of them, would ever be freed. Held by the
# module, the two form a cycle that the garbage collector frees with the module.
STATE_ATTR = "_fullshard_unit_state"


def clean_key(key: str) -> str:
    """``key`` (a dotted module path or state-dict key) without any ``_fsdp_wrapped_module`` segment."""
    return ".".join(part for part in key.split(".") if part != WRAPPED_NAME)

"""``release_memory``: drop references to objects and return the memory their tensors held to the allocator."""

from __future__ import annotations

import gc
from typing import Any

import torch

__all__ = ["release_memory"]


def release_memory(*objects: Any) -> list[None]:
    """Return ``[None] * len(objects)`` after a garbage collection and emptying the CUDA cache.

    Rebind the names to the result (``model, opt = release_memory(model, opt)``): the caller's references are
    what keep the tensors alive, and only the caller can drop them.
    """
    released: list[None] = [None] * len(objects)
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return released

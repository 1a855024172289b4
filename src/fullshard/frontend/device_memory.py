"""Accelerate's ``utils.memory`` helpers that transformers' Trainer calls between steps and on a failed step."""

from __future__ import annotations

import gc

import torch

from fullshard.frontend.modules import _is_oom

__all__ = ["clear_device_cache", "should_reduce_batch_size"]


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return cached device memory to the driver (CUDA only; nothing to do on the CPU)."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def should_reduce_batch_size(exception: Exception) -> bool:
    """Whether ``exception`` is an out-of-memory error, after which a smaller batch may fit."""
    return _is_oom(exception)

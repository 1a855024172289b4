"""Memory helpers of ``accelerate.utils.memory``: releasing references and device caches, retrying with smaller
batches on OOM (and telling an OOM apart, for transformers' Trainer)."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["clear_device_cache", "find_executable_batch_size", "release_memory", "should_reduce_batch_size"]


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


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "DefaultCPUAllocator" in text)


def find_executable_batch_size(
    function: Callable[..., Any] | None = None, starting_batch_size: int = 128, reduce_batch_size_fn: Any = None
) -> Any:
    """Decorator: call ``function(batch_size, ...)`` and halve ``batch_size`` after each out-of-memory error.

    The decorated function must take the batch size as its first argument and is called without it.
    Raises ``RuntimeError`` when the batch size reaches 0.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    shrink = reduce_batch_size_fn or (lambda size: size // 2)
    params = list(inspect.signature(function).parameters)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if len(params) < len(args) + 1:
            raise TypeError(
                f"find_executable_batch_size: call {function.__name__}({', '.join(params[1:])}) without the batch "
                f"size (its first argument, {params[0] if params else '?'}, is supplied); got {len(args)} arguments."
            )
        batch_size = starting_batch_size
        while batch_size > 0:
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not _is_oom(exc):
                    raise
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                batch_size = shrink(batch_size)
        raise RuntimeError(
            f"find_executable_batch_size({function.__name__}): out of memory down to batch size 1. Reduce the "
            "model or sequence size, or shard over more processes."
        )

    return run


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return cached device memory to the driver (CUDA only; nothing to do on the CPU)."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def should_reduce_batch_size(exception: Exception) -> bool:
    """Whether ``exception`` is an out-of-memory error, after which a smaller batch may fit."""
    return _is_oom(exception)

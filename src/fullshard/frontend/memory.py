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
    """Decorator: call ``function(batch_size, ...)`` and shrink ``batch_size`` after each out-of-memory error.

    As in Accelerate 1.15, the default shrink multiplies by 0.9 (``int(size * 0.9)``: 128, 115, 103, ...), and the
    size reached is kept for the next call of the decorated function. ``reduce_batch_size_fn`` replaces it: called
    with no argument (Accelerate's form) it returns the next size; a function of one argument gets the current
    size. The decorated function takes the batch size as its first argument and is called without it. Raises
    ``RuntimeError`` when the batch size reaches 0.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    shrink = _shrink_function(reduce_batch_size_fn)
    params = list(inspect.signature(function).parameters)
    batch_size = starting_batch_size

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        if len(params) < len(args) + 1:
            raise TypeError(
                f"find_executable_batch_size: call {function.__name__}({', '.join(params[1:])}) without the batch "
                f"size (its first argument, {params[0] if params else '?'}, is supplied); got {len(args)} arguments."
            )
        clear_device_cache(garbage_collection=True)
        while batch_size > 0:
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
                clear_device_cache(garbage_collection=True)
                batch_size = shrink(batch_size)
        raise RuntimeError(
            f"find_executable_batch_size({function.__name__}): No executable batch size found, reached zero (out of "
            f"memory from batch size {starting_batch_size} down). Reduce the model or sequence size, or shard over "
            "more processes."
        )

    return run


def _shrink_function(reduce_batch_size_fn: Any) -> Callable[[int], int]:
    """``size -> next size``: ``int(size * 0.9)`` by default, else the user's function of zero or one argument."""
    if reduce_batch_size_fn is None:
        return lambda size: int(size * 0.9)
    try:
        takes_size = len(inspect.signature(reduce_batch_size_fn).parameters) >= 1
    except (TypeError, ValueError):
        takes_size = False
    return reduce_batch_size_fn if takes_size else (lambda size: reduce_batch_size_fn())


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return cached device memory to the driver (CUDA only; nothing to do on the CPU)."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def should_reduce_batch_size(exception: Exception) -> bool:
    """Whether ``exception`` is an out-of-memory error, after which a smaller batch may fit."""
    return _is_oom(exception)

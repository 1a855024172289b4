"""Small model helpers of ``accelerate.utils``: module sizes and retrying with smaller batches on OOM."""

from __future__ import annotations

import functools
import gc
import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["compute_module_sizes", "find_executable_batch_size"]


def compute_module_sizes(
    model: nn.Module, dtype: str | torch.dtype | None = None, special_dtypes: dict[str, Any] | None = None
) -> dict[str, int]:
    """Bytes of the parameters and buffers under every module name ("" is the whole model).

    ``dtype`` counts floating-point tensors at that dtype's size (as if cast); ``special_dtypes`` maps a tensor
    name to the dtype to count it at.
    """

    def size_of(name: str, tensor: torch.Tensor) -> int:
        target = (special_dtypes or {}).get(name, dtype)
        if isinstance(target, str):
            target = getattr(torch, target.replace("torch.", ""))
        if target is not None and tensor.is_floating_point():
            return tensor.numel() * torch.empty((), dtype=target).element_size()
        return tensor.numel() * tensor.element_size()

    sizes: dict[str, int] = defaultdict(int)
    tensors = [*model.named_parameters(remove_duplicate=True), *model.named_buffers(remove_duplicate=True)]
    for name, tensor in tensors:
        size = size_of(name, tensor)
        parts = name.split(".")
        for i in range(len(parts) + 1):
            sizes[".".join(parts[:i])] += size
    return dict(sizes)


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

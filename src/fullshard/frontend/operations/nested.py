"""``convert_to_fp32``, ``listify``, ``slice_tensors``: per-tensor transforms of nested lists, tuples and dicts.

Like everything built on :func:`~fullshard.frontend.ops.recursively_apply`, they keep the structure (named tuples
and mapping types included) and leave non-tensor leaves as they are. None of them communicates.
"""

from __future__ import annotations

from typing import Any

import torch

from fullshard.frontend.ops import recursively_apply

__all__ = ["convert_to_fp32", "listify", "slice_tensors"]

_HALF = (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor: Any) -> Any:
    """Every float16 / bfloat16 tensor in ``tensor`` as float32 (others untouched, not copied)."""
    return recursively_apply(
        lambda t: t.float(), tensor, test_type=lambda t: hasattr(t, "dtype") and getattr(t, "dtype", None) in _HALF
    )


def _to_list(t: torch.Tensor) -> Any:
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).tolist()  # tolist() has no bfloat16 path via numpy


def listify(data: Any) -> Any:
    """Every tensor in ``data`` as Python numbers (``tensor.tolist()``: a number for a 0-d tensor)."""
    return recursively_apply(_to_list, data)


def slice_tensors(data: Any, tensor_slice: Any, process_index: int | None = None, num_processes: int | None = None):
    """``t[tensor_slice]`` for every tensor in ``data`` (``process_index`` / ``num_processes`` are unused, as in
    Accelerate, where they serve its TPU path)."""
    return recursively_apply(lambda t: t[tensor_slice], data)

"""Mixed precision: the entry points' policies resolved once into dtypes, and the casts they imply.

Rules (torch's, for both entry points):
- Sharded parameters keep their dtype; the optimizer steps on them. Gathered parameters are in
  ``param_dtype``, so the all-gather moves ``param_dtype`` bytes.
- Gradients are reduced in ``reduce_dtype`` (default ``param_dtype``) and land in the parameter dtype,
  or stay in ``reduce_dtype`` with ``keep_low_precision_grads``.
- ``FullyShardedDataParallel`` casts the root's floating-point forward inputs to ``param_dtype``
  (``cast_root_forward_inputs``) and every unit's when ``cast_forward_inputs``; buffers are cast to
  ``buffer_dtype`` (default ``param_dtype``). ``fully_shard`` casts every unit's inputs when
  ``cast_forward_inputs`` and its outputs to ``output_dtype``; it leaves buffers alone.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from fullshard.engine.api import MixedPrecision, MixedPrecisionPolicy
from fullshard.ranks import warn_rank0

__all__ = [
    "Casts",
    "GroupPrecision",
    "cast_floating",
    "cast_to",
    "casts_from_mixed_precision",
    "casts_from_policy",
    "group_precision",
    "widened_sum",
]


@dataclass(frozen=True)
class Casts:
    """Resolved mixed precision of one unit; ``None`` means "leave as is"."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    input_dtype: torch.dtype | None = None  # cast inputs of this unit (when it is not the root)
    root_input_dtype: torch.dtype | None = None  # cast inputs when this unit is the root
    output_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class GroupPrecision:
    """Dtypes resolved once per group: compute (gathered parameters), reduction and sharded gradients."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    grad_dtype: torch.dtype


def _check_dtype(value: Any, field: str, owner: str) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(
            f"{owner}({field}={value!r}): {field} must be a floating-point torch.dtype such as torch.bfloat16 "
            "or torch.float16, or None to keep the parameters' dtype."
        )


def casts_from_mixed_precision(mp: MixedPrecision | None) -> Casts:
    """``FullyShardedDataParallel(mixed_precision=...)`` (ours, or torch's by field name) to :class:`Casts`."""
    if mp is None:
        return Casts()
    for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        _check_dtype(getattr(mp, name, None), name, "MixedPrecision")
    param, reduce = mp.param_dtype, mp.reduce_dtype
    if mp.keep_low_precision_grads and param is None and reduce is None:
        warn_rank0(
            "MixedPrecision(keep_low_precision_grads=True) has no effect without param_dtype or reduce_dtype: "
            "gradients are already in the parameters' dtype.",
            stacklevel=3,
        )
    return Casts(
        param_dtype=param,
        reduce_dtype=reduce,
        keep_low_precision_grads=bool(mp.keep_low_precision_grads),
        input_dtype=param if mp.cast_forward_inputs else None,
        root_input_dtype=param if (mp.cast_root_forward_inputs or mp.cast_forward_inputs) else None,
        buffer_dtype=mp.buffer_dtype if mp.buffer_dtype is not None else param,
    )


def casts_from_policy(mp: MixedPrecisionPolicy | None) -> Casts:
    """``fully_shard(mp_policy=...)`` to :class:`Casts`."""
    if mp is None:
        return Casts()
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        _check_dtype(getattr(mp, name, None), name, "MixedPrecisionPolicy")
    cast_in = mp.param_dtype if mp.cast_forward_inputs else None
    return Casts(
        param_dtype=mp.param_dtype,
        reduce_dtype=mp.reduce_dtype,
        input_dtype=cast_in,
        root_input_dtype=cast_in,
        output_dtype=mp.output_dtype,
    )


def group_precision(casts: Casts, dtype: torch.dtype) -> GroupPrecision:
    """The dtypes a group of ``dtype`` parameters gathers, reduces and keeps gradients in."""
    param = casts.param_dtype or dtype
    reduce = casts.reduce_dtype or param
    if casts.reduce_dtype is not None and casts.param_dtype is None and reduce.itemsize > dtype.itemsize:
        warn_rank0(
            f"reduce_dtype={reduce} without param_dtype reduces {dtype} gradients in a wider dtype, which only "
            "costs bandwidth: the result lands in the parameters' dtype. Leave reduce_dtype unset, or set "
            "param_dtype too.",
            stacklevel=4,
        )
    grad = reduce if casts.keep_low_precision_grads else dtype
    return GroupPrecision(param_dtype=param, reduce_dtype=reduce, grad_dtype=grad)


def cast_floating(obj: Any, dtype: torch.dtype | None) -> Any:
    """``obj`` with every floating-point tensor inside cast to ``dtype``, every container keeping its type.

    Containers: lists and tuples (named tuples too), mappings (``dict`` subclasses such as ``OrderedDict``,
    ``defaultdict`` or Hugging Face's ``ModelOutput`` keep their class, attributes and key order) and dataclass
    instances (rebuilt with :func:`dataclasses.replace`, so their ``__post_init__`` sees the cast fields).
    Anything else is returned as it is. A model's output reaches the user through this function, so
    ``outputs.loss`` must survive it whatever the precision setting.
    """
    if dtype is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: cast_floating(getattr(obj, f.name), dtype) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(cast_floating(x, dtype) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating(x, dtype) for x in obj)
    if isinstance(obj, MutableMapping):
        # A shallow copy keeps the subclass, its attributes and (for defaultdict) its factory; items are then
        # replaced through __setitem__, which attribute-access mappings use to keep attributes in step.
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = cast_floating(value, dtype)
        return out
    if isinstance(obj, Mapping):
        return type(obj)({k: cast_floating(v, dtype) for k, v in obj.items()})
    return obj


def cast_to(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, *, non_blocking: bool) -> torch.Tensor:
    """``tensor.to(device, dtype, non_blocking=...)``, without dispatching an op when it is there already (once per
    gather and per reduction)."""
    if tensor.dtype == dtype and tensor.device == device:
        return tensor
    return tensor.to(device, dtype, non_blocking=non_blocking)


def widened_sum(held: torch.Tensor | None, grad: torch.Tensor | None, reduce_dtype: torch.dtype) -> torch.Tensor | None:
    """``grad`` added to ``held`` (the sum of earlier micro-batches' unsharded gradients, or ``None``), kept in
    ``reduce_dtype`` when that is a wider floating dtype than ``grad``'s, as torch's FSDP2 sums micro-batches with
    gradient sync off (float32 under bf16 compute). ``None`` when ``grad`` should stay where autograd sums it (no
    gradient, or ``reduce_dtype`` no wider): the caller then leaves it, and ``held`` is ``None`` too."""
    if grad is None or not reduce_dtype.is_floating_point or reduce_dtype.itemsize <= grad.dtype.itemsize:
        return None
    return grad.to(reduce_dtype) if held is None else held.add_(grad)

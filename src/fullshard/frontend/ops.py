"""Distributed data operations on nested structures of tensors (Accelerate's ``utils.operations``).

Every function takes a tensor or any nesting of lists, tuples and dicts (mappings) of tensors, keeps the
structure, and acts on each tensor. Collectives run over the default process group; without one (or with
one rank) they return their input unchanged (``gather`` and ``reduce`` return a copy, as with many ranks).
Every rank must call a collective with the same structure, in the same order.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from fullshard.ranks import gather_from_ranks, global_rank, rank_and_world

__all__ = [
    "CannotPadNestedTensorWarning",
    "broadcast",
    "convert_outputs_to_fp32",
    "find_device",
    "is_namedtuple",
    "pad_input_tensors",
    "convert_to_fp32",
    "listify",
    "slice_tensors",
    "broadcast_object_list",
    "concatenate",
    "gather",
    "gather_object",
    "is_main_process",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "save",
    "send_to_device",
    "set_seed",
    "wait_for_everyone",
]


def _world() -> int:
    return rank_and_world()[1]


def is_main_process() -> bool:
    """Whether this is rank 0 (or the only process)."""
    return global_rank() == 0


def is_torch_tensor(data: Any) -> bool:
    """Whether ``data`` is a tensor (Accelerate's name for :func:`recursively_apply`'s default ``test_type``)."""
    return isinstance(data, torch.Tensor)


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply ``func(leaf, *args, **kwargs)`` to every leaf of ``data`` that passes ``test_type``.

    Lists, tuples (named tuples too) and mappings keep their type; other leaves are returned as they are, or
    raise ``TypeError`` with ``error_on_other_type``.
    """

    def again(item: Any) -> Any:
        return recursively_apply(
            func, item, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
        )

    if isinstance(data, (tuple, list)):
        items = [again(d) for d in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if isinstance(data, Mapping):
        return type(data)({k: again(v) for k, v in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:  # Accelerate's words exactly (its tests compare the whole message): type, function, fix
        raise TypeError(
            f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', repr(func))}`. Only nested "
            f"list/tuple/dicts of objects that are valid for `{getattr(test_type, '__name__', repr(test_type))}` "
            "should be passed."
        )
    return data


def send_to_device(
    tensor: Any, device: torch.device | str, non_blocking: bool = False, skip_keys: list[str] | str | None = None
) -> Any:
    """Move every tensor (and anything with a ``.to``) in ``tensor`` to ``device``; dict keys in ``skip_keys``
    are left where they are."""
    skip = [skip_keys] if isinstance(skip_keys, str) else list(skip_keys or [])
    if isinstance(tensor, Mapping) and skip:
        return type(tensor)(
            {k: v if k in skip else send_to_device(v, device, non_blocking, skip) for k, v in tensor.items()}
        )

    def move(t: Any) -> Any:
        try:
            return t.to(device, non_blocking=non_blocking)
        except TypeError:  # a .to() without non_blocking
            return t.to(device)

    return recursively_apply(move, tensor, test_type=lambda t: hasattr(t, "to") and not isinstance(t, type))


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Overwrite every tensor in ``tensor`` with ``from_process``'s, in place; returns ``tensor``."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if _world() > 1:
            dist.broadcast(t, src=from_process)
        return t

    return recursively_apply(one, tensor, error_on_other_type=True)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace the items of ``object_list`` (picklable) with ``from_process``'s, in place; returns the list."""
    if _world() > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def _gather_one(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.ndim == 0:
        t = t.reshape(1)
    world = _world()
    if world == 1:
        return t.clone()
    sizes = [torch.zeros((), dtype=torch.long, device=t.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor(t.shape[0], device=t.device))
    longest = int(max(s.item() for s in sizes))
    padded = _pad(t.contiguous(), 0, longest, 0, False)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(n.item())] for p, n in zip(parts, sizes)], dim=0)


def gather(tensor: Any) -> Any:
    """Concatenate every rank's tensors along dim 0, in rank order (0-dim tensors become shape ``(world,)``).

    Ranks may hold different sizes on dim 0 (the other dims must agree): each contributes all its rows.
    """
    return recursively_apply(_gather_one, tensor, error_on_other_type=True)


def gather_object(object: Any) -> list[Any]:
    """Every rank's items (``object`` must be a list or another iterable), concatenated in rank order."""
    return [item for part in gather_from_ranks(list(object)) for item in part]


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Sum (``reduction="sum"``) or average (``"mean"``) every tensor across ranks, times ``scale``; new tensors."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f'reduce(reduction={reduction!r}): not a reduction. Use "mean", "sum" or "none".')

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        if reduction != "none" and _world() > 1:
            dist.all_reduce(out)
        if reduction == "mean":
            out = out / _world()
        return out * scale if scale != 1.0 else out

    return recursively_apply(one, tensor, error_on_other_type=True)


def _pad(t: torch.Tensor, dim: int, size: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    if t.shape[dim] >= size:
        return t
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_full(shape, pad_index)
    start = size - t.shape[dim] if pad_first else 0
    out.narrow(dim, start, t.shape[dim]).copy_(t)
    return out


class CannotPadNestedTensorWarning(UserWarning):
    """:func:`pad_across_processes` met a nested tensor and left it as it is."""


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad every tensor with ``pad_index`` on ``dim`` to the largest size any rank holds, so it can be gathered.

    A tensor without a dimension ``dim`` is returned as it is, as in Accelerate (transformers' ``Trainer`` pads
    labels on ``dim=1`` whether they are sequences or one class per sample).
    """

    def one(t: torch.Tensor) -> torch.Tensor:
        if getattr(t, "is_nested", False):
            warnings.warn(
                "pad_across_processes: a nested tensor has no single size on a dimension to pad to; it is returned "
                "as it is. Pad its components before nesting them.",
                CannotPadNestedTensorWarning,
                stacklevel=4,
            )
            return t
        if dim >= t.ndim or dim < -t.ndim:
            return t
        d = dim % t.ndim
        size = torch.tensor(t.shape[d], device=t.device)
        if _world() > 1:
            dist.all_reduce(size, op=dist.ReduceOp.MAX)
        return _pad(t, d, int(size.item()), pad_index, pad_first)

    return recursively_apply(one, tensor, error_on_other_type=True)


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """Concatenate a list of equally structured nestings of tensors, leaf by leaf, along ``dim``."""
    if not isinstance(data, (list, tuple)) or not data:
        raise ValueError(f"concatenate(data={type(data).__name__}): expected a non-empty list of nested tensors.")
    first = data[0]
    if len(data) == 1:  # nothing to join: the one element as it is (Accelerate's answer, of any type)
        return first
    if isinstance(first, (tuple, list)):
        items = [concatenate([d[i] for d in data], dim=dim) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim=dim) for k in first})
    if not torch.is_tensor(first):
        raise TypeError(f"concatenate: found a {type(first).__name__}; only nested tensors can be concatenated.")
    return torch.cat(list(data), dim=dim)


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, ``numpy`` (if installed) and torch (CPU and CUDA) with ``seed``.

    ``device_specific`` adds the process index, so that ranks draw different numbers; ``deterministic``
    also asks torch for deterministic algorithms.
    """
    if device_specific:
        seed += global_rank()
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def wait_for_everyone() -> None:
    """Barrier over all processes (no-op with one)."""
    if _world() > 1:
        dist.barrier()


def save(
    obj: Any, f: str | os.PathLike[str], save_on_each_node: bool = False, safe_serialization: bool = False
) -> None:
    """Save ``obj`` to ``f`` on the main process only (on each node's local main with ``save_on_each_node``).

    ``safe_serialization`` writes safetensors (``obj`` must be a flat dict of tensors), else ``torch.save``.
    """
    local_main = int(os.environ.get("LOCAL_RANK", global_rank())) == 0
    if not (local_main if save_on_each_node else is_main_process()):
        return
    if safe_serialization:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in _without_shared(obj).items()}, str(f), metadata={"format": "pt"})
    else:
        torch.save(obj, f)


def _without_shared(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with one name per storage (safetensors refuses tensors that share memory, e.g. tied weights):
    the first name in sorted order stays; the others are dropped with one warning naming them."""
    kept: dict[Any, str] = {}
    dropped = []
    for name in sorted(state):
        value = state[name]
        key = (
            (value.untyped_storage().data_ptr(), value.storage_offset(), value.shape)
            if torch.is_tensor(value)
            else None
        )
        if key is not None and key[0] != 0 and key in kept:
            dropped.append(name)
        elif key is not None:
            kept[key] = name
    if dropped:
        logging.getLogger(__name__).warning(
            f"save(safe_serialization=True): Removed shared tensor {dropped} while saving (they share memory with "
            "tensors that are saved); retie them after loading (e.g. model.tie_weights())."
        )
    return {k: v for k, v in state.items() if k not in dropped}


# --- per-tensor transforms (no communication) -------------------------------------------------------

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


def is_namedtuple(data: Any) -> bool:
    """Whether ``data`` is a named tuple (a tuple with ``_fields`` and ``_asdict``), subclasses included."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor found in ``data`` (nested lists, tuples, mappings), ``None`` without one."""
    if isinstance(data, torch.Tensor):
        return data.device
    items = data.values() if isinstance(data, Mapping) else data if isinstance(data, (list, tuple)) else ()
    for item in items:
        device = find_device(item)
        if device is not None:
            return device
    return None


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Every tensor of ``tensor`` (``batch_size`` rows on dim 0) zero-padded on dim 0 to the next multiple of
    ``num_processes`` rows (at least ``num_processes``), so that each process gets as many rows."""
    rows = max(-(-batch_size // num_processes), 1) * num_processes

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] >= rows:
            return t
        out = t.new_zeros((rows, *t.shape[1:]))
        out[: t.shape[0]] = t
        return out

    return recursively_apply(one, tensor, error_on_other_type=True)


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """``model_forward`` whose float16/bfloat16 outputs come back as float32; ``__wrapped__`` is the original, so
    ``extract_model_from_parallel(model, keep_fp32_wrapper=False)`` takes it off again."""

    @functools.wraps(model_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(model_forward(*args, **kwargs))

    return forward

"""What a whole-parameter step exchanges of one parameter (see [Note: exchange memory] in ``whole_step.py``): the
kinds of its optimizer state, and its pieces as bytes.

A state value is per-element (``("rows", dtype)``: a shard at rest, like AdamW's), whole (``("whole", dtype,
shape)``: the same on every rank) or not a tensor (``("value", object)``). Invariants: the kinds of a parameter's
state are the same on every rank (the owner's :func:`whole_spec`, sent once), and the whole names are recorded in
its param group (``WHOLE_STATES_KEY``), so a saved optimizer state dict says which states are whole; the bytes one
rank sends for a piece are exactly what :func:`nbytes` says the receiver expects (rows of its dim-0 layout, or the
whole state), so the all-to-all splits agree on every rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fullshard.algorithms.whole_owners import Entry
from fullshard.engine import WHOLE_STATES_KEY, local_tensor

__all__ = [
    "Kind",
    "as_bytes",
    "concat",
    "copy_bytes",
    "fits",
    "may_change",
    "nbytes",
    "rows_like",
    "rows_of",
    "set_whole_names",
    "whole_names_of",
    "whole_spec",
]

# kinds of one state value: ("rows", dtype) per-element; ("whole", dtype, shape) the same on every rank;
# ("value", object) a non-tensor value
Kind = tuple[Any, ...]


def rows_of(e: Entry, whole: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    """Shard rank ``rank``'s rows of the whole (global) ``whole``: of its tp part, for a tensor parallel one."""
    return e.sp.rows_of(e.sp.gathered_of_full(whole), rank)


def whole_spec(e: Entry, state: dict[str, Any]) -> list[tuple[str, Kind]]:
    """The kinds of the owner's whole state: a tensor shaped like the parameter is per-element, others whole."""
    spec: list[tuple[str, Kind]] = []
    for name in sorted(state):
        value = state[name]
        if not isinstance(value, torch.Tensor):
            spec.append((name, ("value", value)))
        elif value.dim() > 0 and tuple(value.shape) == tuple(e.sp.shape):
            spec.append((name, ("rows", value.dtype)))
        else:
            spec.append((name, ("whole", value.dtype, tuple(value.shape))))
    return spec


def may_change(spec: list[tuple[str, Kind]]) -> bool:
    """Whether the owner's step may give state of other kinds than ``spec`` (the same answer on every rank)."""
    return not spec or any(kind[0] == "value" for _, kind in spec)


def whole_names_of(optimizer: torch.optim.Optimizer, position: tuple[int, int]) -> list[str]:
    group, i = optimizer.param_groups[position[0]], position[1]
    lists = group.get(WHOLE_STATES_KEY)
    return list(lists[i]) if lists and i < len(lists) else []


def set_whole_names(optimizer: torch.optim.Optimizer, position: tuple[int, int], spec: list[tuple[str, Kind]]) -> None:
    group, i = optimizer.param_groups[position[0]], position[1]
    lists = group.setdefault(WHOLE_STATES_KEY, [])
    lists.extend([] for _ in range(len(group["params"]) - len(lists)))
    lists[i] = [name for name, kind in spec if kind[0] == "whole" and len(kind[2]) > 0]


def rows_like(param: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as the optimizer holds a per-element state of ``param`` (a ``DTensor`` like it, if it is one)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            rows, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return rows


def fits(old: Any, shape: torch.Size, dtype: torch.dtype) -> bool:
    return isinstance(old, torch.Tensor) and local_tensor(old).shape == shape and old.dtype == dtype


def copy_bytes(dst: torch.Tensor, data: torch.Tensor) -> None:
    """Copy ``data`` (``dst``'s bytes, uint8) into ``dst`` without an intermediate tensor where ``dst`` allows."""
    if dst.is_contiguous():
        dst.reshape(-1).view(torch.uint8).copy_(data)
    else:  # a Shard(d) parameter's movedim view
        dst.copy_(data.clone().view(dst.dtype).view(dst.shape))


def concat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def nbytes(e: Entry, rank: int, dtype: torch.dtype, kind: Kind = ("rows",)) -> int:
    if kind[0] == "whole":
        return math.prod(kind[2]) * dtype.itemsize
    return e.sp.layout.for_rank(rank).local_numel * dtype.itemsize

"""Work split over processes: the ``on_*_process`` decorators and ``split_between_processes``.

[Note: process decorators]
``accelerator.on_main_process(fn)`` returns a function that calls ``fn`` on the main process and returns
``None`` elsewhere. The rank is read when the decorated function is *called*, not when it is decorated, so a
method of a class body decorated before any ``Accelerator`` exists works (Accelerate decides at call time for
methods too). With one process every decorated function runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from fullshard.ranks import rank_and_world

__all__ = ["only_on", "split_between_processes", "split_bounds"]


def only_on(function: Callable[..., Any], should_run: Callable[[], bool]) -> Callable[..., Any]:
    """``function`` run only where ``should_run()`` is true at call time (see [Note: process decorators])."""
    if not callable(function):
        raise TypeError(
            f"on_*_process decorator: expected a function, got {type(function).__name__}. Use it as "
            "@accelerator.on_main_process above a def, or @accelerator.on_process(process_index=1)."
        )

    @functools.wraps(function)
    def run_here(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs) if should_run() else None

    return run_here


def split_bounds(length: int, num_processes: int, process_index: int) -> tuple[int, int]:
    """``[start, end)`` of this process's part of ``length`` items: contiguous, the first ``length % n`` parts
    one item longer than the others (Accelerate's split)."""
    per, extra = divmod(length, num_processes)
    start = process_index * per + min(process_index, extra)
    return start, start + per + (1 if process_index < extra else 0)


def _length(inputs: Any) -> int:
    if isinstance(inputs, Mapping):
        lengths = {k: len(v) for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"split_between_processes(inputs=dict): every value must have the same length, got {lengths}."
            )
        return next(iter(lengths.values()), 0)
    if not hasattr(inputs, "__len__") or not hasattr(inputs, "__getitem__"):
        raise TypeError(
            f"split_between_processes(inputs={type(inputs).__name__}): expected a list, tuple, tensor, or a dict "
            "of them (anything with len() and slicing)."
        )
    return len(inputs)


def _part(value: Any, start: int, end: int, padded_length: int | None) -> Any:
    if isinstance(value, Mapping):
        return type(value)({k: _part(v, start, end, padded_length) for k, v in value.items()})
    part = value[start:end]
    if padded_length is None or len(part) >= padded_length or len(value) == 0:
        return part
    missing = padded_length - len(part)
    if isinstance(value, torch.Tensor):
        return torch.cat([part, value[-1:].expand(missing, *value.shape[1:])])
    return part + type(part)([value[-1]] * missing)


@contextlib.contextmanager
def split_between_processes(inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
    """Yield this process's contiguous part of ``inputs`` (see :func:`split_bounds`); a dict is split value by
    value. ``apply_padding`` repeats the last item so that every process gets the same count (drop the repeats
    after a ``gather``). The input is never modified."""
    rank, world = rank_and_world()
    if world == 1:
        yield inputs
        return
    length = _length(inputs)
    start, end = split_bounds(length, world, rank)
    padded = -(-length // world) if apply_padding else None
    yield _part(inputs, start, end, padded)

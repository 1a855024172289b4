"""Accelerate's free ``prepare_data_loader(dataloader, ...)``: a loader prepared without an ``Accelerator``.

The number of processes and this process's index default to the process group's (one process without one);
batches go to the process's device only with ``put_on_device=True``. A map-style loader with a fixed
``batch_size`` is dealt as the Accelerator deals it (``data.prepare_data_loader``); a stream or a custom batch
sampler as Accelerate deals it (``loader_parts.shard_loader``); ``dispatch_batches=True`` gives a
``DataLoaderDispatcher``. The loader shares the process's ``GradientState``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from fullshard.frontend.data import loader_parts
from fullshard.frontend.data import sharded_loader as data
from fullshard.frontend.processes.shared_state import PartialState

__all__ = ["prepare_data_loader"]


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: Any = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Any = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> DataLoader:
    """This process's share of ``dataloader`` (see the module docstring)."""
    for name, value in (("slice_fn_for_dispatch", slice_fn_for_dispatch), ("torch_device_mesh", torch_device_mesh)):
        if value is not None:
            raise NotImplementedError(
                f"prepare_data_loader({name}=...): not supported by fullshard; leave it None (batches are cut on "
                "dim 0; a ParallelismConfig goes to the Accelerator)."
            )
    grouped = dist.is_available() and dist.is_initialized()
    n = num_processes if num_processes is not None else (dist.get_world_size() if grouped else 1)
    k = process_index if process_index is not None else (dist.get_rank() if grouped else 0)
    target = (device or PartialState().device) if put_on_device else None
    if dispatch_batches:
        return loader_parts.dispatch_loader(
            dataloader, device=target, split_batches=split_batches, non_blocking=non_blocking
        )
    if loader_parts.dealt_as_accelerate(dataloader):
        return loader_parts.shard_loader(
            dataloader, num_processes=n, process_index=k, device=target, split_batches=split_batches,
            even_batches=even_batches, non_blocking=non_blocking, rng_types=rng_types,
        )  # fmt: skip
    return data.prepare_data_loader(
        dataloader, num_processes=n, process_index=k, device=target, gradient_state=data.GradientState(),
        even_batches=even_batches, split_batches=split_batches, use_seedable_sampler=use_seedable_sampler,
        data_seed=data_seed, non_blocking=non_blocking, use_stateful_dataloader=use_stateful_dataloader,
        rng_types=tuple(rng_types) if rng_types is not None else ("generator",),
    )  # fmt: skip

"""Dataloaders for ``Accelerator.prepare``: each rank iterates its share of every global batch.

[Note: batch dealing]
A prepared loader of batch size ``B`` on ``n`` ranks deals the original loader's batches round-robin, as
Accelerate does: at step ``s`` rank ``k`` gets batch ``s * n + k``. So the ``n`` batches of one step, taken in
rank order, are the contiguous global batch ``[s * n * B, (s + 1) * n * B)`` of the sampler's order, and
``gather`` of per-rank outputs lists the samples in that order.

- Shuffling: a loader whose sampler is a ``RandomSampler`` draws one permutation per epoch from a seed that
  rank 0 draws from its own torch RNG and broadcasts, so every rank deals the same permutation (and a run
  resumed with the saved RNG states draws the same permutations again).
- ``even_batches=True`` (default): when the last step has fewer than ``n * B`` samples, it is completed with
  samples from the start of the epoch, so every rank runs the same number of full batches (no rank waits in
  a collective the others never reach). :attr:`ShardedDataLoader.remainder` is the number of real samples in
  that last step; ``gather_for_metrics`` drops the rest.
- ``even_batches=False``: the batches are dealt as they are; the last ones may be short or missing on some ranks.
- ``drop_last=True``: the incomplete last step is dropped instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from fullshard.frontend.ops import send_to_device

__all__ = ["GradientState", "ShardBatchSampler", "ShardedDataLoader", "prepare_data_loader"]


@dataclass
class GradientState:
    """What the prepared objects share about the current step (Accelerate's ``GradientState``).

    - ``sync_gradients``: this step reduces gradients and the optimizer steps (not an accumulation step).
    - ``end_of_dataloader``: the batch being processed is the last of the active prepared loader.
    - ``remainder``: real samples in that last global batch (``-1``: unknown or none padded).
    """

    num_steps: int = 1
    sync_gradients: bool = True
    end_of_dataloader: bool = False
    remainder: int = -1
    step: int = 0


class ShardBatchSampler:
    """The index lists rank ``rank`` of ``num_processes`` iterates in one epoch; see [Note: batch dealing]."""

    def __init__(
        self, sampler: Any, batch_size: int, num_processes: int, rank: int, *, drop_last: bool, even_batches: bool
    ) -> None:
        self.sampler, self.batch_size = sampler, batch_size
        self.num_processes, self.rank = num_processes, rank
        self.drop_last, self.even_batches = drop_last, even_batches
        self.epoch = 0
        self.remainder = -1

    def _order(self) -> list[int]:
        if isinstance(self.sampler, RandomSampler):
            seed = torch.randint(0, 2**62, (1,), generator=self.sampler.generator)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(seed, src=0)
            g = torch.Generator().manual_seed(int(seed.item()))
            s = self.sampler
            return list(RandomSampler(s.data_source, s.replacement, s._num_samples, generator=g))
        return list(iter(self.sampler))

    def _global_batches(self, order: list[int]) -> list[list[int]]:
        step = self.batch_size * self.num_processes
        full, extra = divmod(len(order), step)
        self.remainder = extra if extra and self.even_batches and not self.drop_last else -1
        if self.drop_last or extra == 0:
            order = order[: full * step]
        elif self.even_batches:
            need = step - extra
            order = order + (order * (need // max(len(order), 1) + 1))[:need]
        return [order[i : i + step] for i in range(0, len(order), step)]

    def __iter__(self) -> Iterator[list[int]]:
        b = self.batch_size
        for global_batch in self._global_batches(self._order()):
            mine = global_batch[self.rank * b : (self.rank + 1) * b]
            if mine:
                yield mine

    def __len__(self) -> int:
        n = len(self.sampler)
        step = self.batch_size * self.num_processes
        full, extra = divmod(n, step)
        if self.drop_last or extra == 0:
            return full
        if self.even_batches:
            return full + 1
        return full + (1 if extra > self.rank * self.batch_size else 0)


class ShardedDataLoader(DataLoader):
    """A ``DataLoader`` over this rank's batches that moves them to ``device`` and reports the last batch.

    While the last batch is being processed ``gradient_state.end_of_dataloader`` is ``True`` and
    ``gradient_state.remainder`` says how many samples of the last global batch are real.
    """

    def __init__(self, dataset: Any, *, device: torch.device | None, gradient_state: GradientState, **kwargs: Any):
        super().__init__(dataset, **kwargs)
        self.device = device
        self.gradient_state = gradient_state

    @property
    def remainder(self) -> int:
        return getattr(self.batch_sampler, "remainder", -1)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.batch_sampler, "epoch"):
            self.batch_sampler.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        state = self.gradient_state
        state.end_of_dataloader = False
        iterator = super().__iter__()
        try:
            current = next(iterator)
        except StopIteration:
            return
        while True:
            try:
                upcoming = next(iterator)
            except StopIteration:
                state.end_of_dataloader, state.remainder = True, self.remainder
                yield current if self.device is None else send_to_device(current, self.device)
                break
            yield current if self.device is None else send_to_device(current, self.device)
            current = upcoming
        state.end_of_dataloader = False


def prepare_data_loader(
    loader: DataLoader,
    *,
    num_processes: int,
    process_index: int,
    device: torch.device | None,
    gradient_state: GradientState,
    even_batches: bool = True,
) -> ShardedDataLoader:
    """This rank's share of ``loader`` (see [Note: batch dealing]); the original loader is left unchanged."""
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            f"Accelerator.prepare(dataloader) got a DataLoader over an IterableDataset "
            f"({type(loader.dataset).__name__}): fullshard deals batches by index. Use a map-style Dataset "
            "(with __getitem__ and __len__), or shard the stream yourself by process_index."
        )
    if loader.batch_size is None:
        raise ValueError(
            "Accelerator.prepare(dataloader) got a DataLoader with batch_size=None (a custom batch_sampler): "
            "fullshard deals fixed-size batches. Pass batch_size=... and sampler=... to the DataLoader instead."
        )
    batch_sampler = ShardBatchSampler(
        loader.sampler,
        loader.batch_size,
        num_processes,
        process_index,
        drop_last=loader.drop_last,
        even_batches=even_batches,
    )
    return ShardedDataLoader(
        loader.dataset,
        device=device,
        gradient_state=gradient_state,
        batch_sampler=batch_sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers,
    )

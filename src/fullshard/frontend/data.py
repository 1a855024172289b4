"""Dataloaders for ``Accelerator.prepare``: each rank iterates its share of every global batch.

[Note: batch dealing]
A prepared loader of batch size ``B`` on ``n`` ranks deals the original loader's batches round-robin, as
Accelerate does: at step ``s`` rank ``k`` gets batch ``s * n + k``. So the ``n`` batches of one step, taken in
rank order, are the contiguous global batch ``[s * n * B, (s + 1) * n * B)`` of the sampler's order, and
``gather`` of per-rank outputs lists the samples in that order.

- Shuffling: a loader whose sampler is a ``RandomSampler`` deals the permutation of ``seed + epoch``, where
  ``seed`` is drawn once (at ``prepare``) by rank 0 from its torch RNG and broadcast, so every rank deals the
  same permutation. The epoch advances each time the loader is exhausted.
- Resuming: :meth:`ShardedDataLoader.state_dict` holds the seed, the epoch and the batches already taken in
  it; ``save_state`` writes it (``sampler.bin``) and after ``load_state`` the next iteration skips those
  batches, so a run resumed mid-epoch sees exactly the batches the uninterrupted run would.
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

_END = object()


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
        self.seed = 0
        if isinstance(sampler, RandomSampler):
            seed = torch.randint(0, 2**62, (1,), generator=sampler.generator)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(seed, src=0)
            self.seed = int(seed.item())

    def _order(self) -> list[int]:
        if isinstance(self.sampler, RandomSampler):
            g = torch.Generator().manual_seed(self.seed + self.epoch)
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
        self._batches_done = 0  # batches yielded in the current epoch
        self._skip = 0  # batches to skip at the next iteration (after load_state_dict)

    @property
    def remainder(self) -> int:
        return getattr(self.batch_sampler, "remainder", -1)

    def set_epoch(self, epoch: int) -> None:
        """Deal the permutation of ``epoch`` next (the epoch also advances by itself at each end)."""
        self.batch_sampler.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        """Where the loader stands: its shuffling seed, the epoch, and the batches taken in it so far."""
        sampler = self.batch_sampler
        return {"seed": sampler.seed, "epoch": sampler.epoch, "batches_done": self._batches_done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``: the next iteration skips the batches already taken in its epoch."""
        self.batch_sampler.seed, self.batch_sampler.epoch = int(state["seed"]), int(state["epoch"])
        self._batches_done = self._skip = int(state["batches_done"])

    def __iter__(self) -> Iterator[Any]:
        state = self.gradient_state
        state.end_of_dataloader = False
        skip, self._skip, self._batches_done = self._skip, 0, 0
        iterator = super().__iter__()
        for _ in range(skip):
            next(iterator, None)
            self._batches_done += 1
        current = next(iterator, _END)
        while current is not _END:
            upcoming = next(iterator, _END)
            if upcoming is _END:
                state.end_of_dataloader, state.remainder = True, self.remainder
            self._batches_done += 1
            yield current if self.device is None else send_to_device(current, self.device)
            current = upcoming
        state.end_of_dataloader = False
        self.batch_sampler.epoch += 1
        self._batches_done = 0


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

"""Accelerate's data-loading building blocks (``accelerate.data_loader``), for code that builds its own loaders.

The Accelerator's own loaders are :class:`~fullshard.frontend.data.ShardedDataLoader` (see [Note: batch dealing]
in ``sharded_loader.py``), a kind of :class:`DataLoaderShard`; these are the pieces Accelerate exports, with its
semantics, for scripts and libraries that use them directly:

- :class:`BatchSamplerShard`: rank ``k`` of ``n`` gets batches ``k, k + n, ...`` of a batch sampler (or the
  ``k``-th ``1/n`` of every batch with ``split_batches``). With ``even_batches`` (and no ``drop_last``) the last
  round is completed from the start of the epoch: a short batch is filled up, and ranks without a batch get
  fresh ones, continuing the epoch's first samples cyclically (whole first batches when the sampler has no
  fixed ``batch_size``), so every rank runs as many batches as the others.
- :class:`IterableDatasetShard`: the same for an iterable dataset, element by element.
- :class:`SeedableRandomSampler`: a ``RandomSampler`` whose epoch ``e`` is the permutation of seed
  ``initial_seed + e``, so every rank draws the same order.
- :class:`SkipBatchSampler`, :class:`SkipDataLoader`: without the first ``skip_batches`` batches.
- :class:`DataLoaderShard`: a ``DataLoader`` that moves batches to ``device``, flags its last batch
  (``end_of_dataloader``, also on the shared ``GradientState``) and counts epochs (``iteration``).
- :class:`DataLoaderDispatcher`: the main process iterates the loader and sends each rank its part of every
  global batch (``broadcast_object_list``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from fullshard.frontend.data.gradient_state import GradientState
from fullshard.frontend.ops import concatenate, send_to_device, slice_tensors

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "dealt_as_accelerate",
    "dispatch_loader",
    "loader_kwargs",
    "shard_loader",
]


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` that draws epoch ``e`` with seed ``initial_seed + e`` (``data_seed``, else torch's
    initial seed), then moves to the next epoch; ``set_epoch`` picks the epoch."""

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def _cycled(source: list[Any], start: int, count: int) -> list[Any]:
    """``count`` items of ``source`` repeated end to end, from position ``start``."""
    return [source[(start + i) % len(source)] for i in range(count)]


class BatchSamplerShard(BatchSampler):
    """Rank ``process_index``'s batches of ``batch_sampler``; see the module docstring for the dealing."""

    def __init__(
        self,
        batch_sampler: Any,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.num_processes, self.process_index = num_processes, process_index
        self.split_batches, self.even_batches = split_batches, even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        if split_batches and (self.batch_size is None or self.batch_size % num_processes != 0):
            raise ValueError(
                f"BatchSamplerShard(split_batches=True): the batch size ({self.batch_size}) must be a round multiple "
                f"of the number of processes ({num_processes}); use a batch sampler with such a fixed batch_size, or "
                "split_batches=False."
            )

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        total = len(self.batch_sampler)
        if self.split_batches:
            return total
        rounds, extra = divmod(total, self.num_processes)
        if extra == 0 or self.drop_last:
            return rounds
        if self.even_batches:
            return rounds + 1
        return rounds + (1 if self.process_index < extra else 0)

    def __iter__(self) -> Iterator[list[Any]]:
        return self._split() if self.split_batches else self._dealt()

    def _full(self, batch: list[Any]) -> bool:
        return self.batch_size is None or len(batch) == self.batch_size

    def _split(self) -> Iterator[list[Any]]:
        width = self.batch_size // self.num_processes  # type: ignore[operator]
        mine = slice(width * self.process_index, width * (self.process_index + 1))
        first: list[Any] = []
        last: list[Any] = []
        for batch in self.batch_sampler:
            first, last = first or list(batch), list(batch)
            if self._full(last):
                yield last[mine]
        if self.drop_last or not first or self._full(last):
            return
        if self.even_batches:
            yield (last + _cycled(first, 0, self.batch_size - len(last)))[mine]  # type: ignore[operator]
        elif len(last) > mine.start:
            yield last[mine]

    def _dealt(self) -> Iterator[list[Any]]:
        n, k = self.num_processes, self.process_index
        head: list[Any] = []  # the epoch's first n batches (their samples, or the batches themselves)
        round_: list[list[Any]] = []
        unfinished: list[list[Any]] = []  # a round of n whose last batch was short: dropped unless it is the last
        for i, batch in enumerate(self.batch_sampler):
            if not self.drop_last and i < n:
                head.extend(batch if self.batch_size is not None else [batch])
            round_.append(list(batch))
            unfinished = []
            if len(round_) == n:
                if self._full(round_[-1]):
                    yield round_[k]
                else:
                    unfinished = round_
                round_ = []
        round_ = round_ or unfinished
        if self.drop_last or not head or not round_:
            return
        if not self.even_batches:
            if k < len(round_):
                yield round_[k]
            return
        yield from self._completed(round_, head)

    def _completed(self, round_: list[list[Any]], head: list[Any]) -> Iterator[list[Any]]:
        """This rank's batch of the last round, completed from ``head`` as the module docstring says."""
        k = self.process_index
        short = not self._full(round_[-1])
        if k < len(round_) - 1 or (k == len(round_) - 1 and not short):
            yield round_[k]
            return
        pos = 0  # where in head the completion continues
        for slot in range(len(round_) - 1 if short else len(round_), self.num_processes):
            if self.batch_size is None:
                batch, pos = head[pos % len(head)], pos + 1
            else:
                have = round_[slot] if slot < len(round_) else []
                need = self.batch_size - len(have)
                batch, pos = have + _cycled(head, pos, need), pos + need
            if slot == k:
                yield batch
                return


class IterableDatasetShard(IterableDataset):
    """Rank ``process_index``'s elements of an iterable ``dataset``: of each run of ``batch_size * num_processes``
    elements (``batch_size`` with ``split_batches``) its ``batch_size`` (``batch_size / num_processes``); a short
    last run is dropped (``drop_last``) or completed with the first run's elements."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ) -> None:
        if split_batches and batch_size > 1 and batch_size % num_processes != 0:
            raise ValueError(
                f"IterableDatasetShard(split_batches=True): the batch size ({batch_size}) must be a round multiple of "
                f"the number of processes ({num_processes})."
            )
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.num_processes, self.process_index, self.split_batches = num_processes, process_index, split_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        per_run = self.batch_size * self.num_processes
        runs = len(self.dataset) // per_run if self.drop_last else math.ceil(len(self.dataset) / per_run)
        return runs * self.batch_size

    def __iter__(self) -> Iterator[Any]:
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.epoch)
        run = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        width = self.batch_size // self.num_processes if self.split_batches else self.batch_size
        mine = slice(self.process_index * width, (self.process_index + 1) * width)
        first: list[Any] | None = None
        current: list[Any] = []
        for element in self.dataset:
            current.append(element)
            if len(current) == run:
                yield from current[mine]
                first = first if first is not None else current
                current = []
        if self.drop_last or not current:
            return
        filler = first if first is not None else list(current)
        while len(current) < run:
            current += filler
        yield from current[mine]


class SkipBatchSampler(BatchSampler):
    """``batch_sampler`` without its first ``skip_batches`` batches."""

    def __init__(self, batch_sampler: Any, skip_batches: int = 0) -> None:
        self.batch_sampler, self.skip_batches = batch_sampler, skip_batches

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.batch_sampler):
            if i >= self.skip_batches:
                yield batch

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return len(self.batch_sampler) - self.skip_batches


class _Self:
    """``loader.base_dataloader``: the ``DataLoader`` a loader iterates (here the loader itself); none on the class."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            raise AttributeError("base_dataloader is an attribute of a loader, not of its class")
        return obj


class DataLoaderStateMixin:
    """``end_of_dataloader`` (the batch being yielded is the last) and ``remainder`` (real samples in the last
    global batch, ``-1`` when unknown), mirrored on the shared ``GradientState`` while the loader runs."""

    end_of_dataloader = False
    remainder = -1
    base_dataloader = _Self()

    def reset(self) -> None:
        self.end_of_dataloader, self.remainder = False, -1

    def begin(self) -> None:
        self.reset()
        state = GradientState()
        total = getattr(self, "total_batch_size", None)
        if not getattr(self, "_drop_last", False) and total:
            with contextlib.suppress(TypeError):  # an unsized dataset has no remainder
                self.remainder = len(self.dataset) % total  # type: ignore[attr-defined]
        state.end_of_dataloader, state.remainder = False, self.remainder

    def _mark_last(self) -> None:
        self.end_of_dataloader = True
        state = GradientState()
        state.end_of_dataloader, state.remainder = True, self.remainder

    def end(self) -> None:
        GradientState().end_of_dataloader = False


def _set_epoch_of_parts(loader: DataLoader, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader's batch sampler, its sampler (or the one inside), else its dataset."""
    batch_sampler = loader.batch_sampler
    for owner in (batch_sampler, getattr(batch_sampler, "batch_sampler", None)):  # a BatchSamplerShard's too
        if hasattr(owner, "set_epoch"):
            owner.set_epoch(epoch)
    inner = getattr(batch_sampler, "sampler", None)
    nested = getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None)
    if hasattr(inner, "set_epoch"):
        inner.set_epoch(epoch)
    if hasattr(nested, "set_epoch"):
        nested.set_epoch(epoch)
    elif hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)


class DataLoaderShard(DataLoaderStateMixin, DataLoader):
    """A ``DataLoader`` whose batches go to ``device``, whose last batch is flagged, and which counts epochs.

    ``iteration`` is the epoch dealt next; each iteration calls ``set_epoch(iteration)`` on the samplers first.
    ``skip_batches`` skips that many batches of every epoch.
    """

    def __init__(
        self,
        dataset: Any,
        device: torch.device | None = None,
        rng_types: Any = None,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> None:
        if use_stateful_dataloader:
            raise NotImplementedError(
                f"{type(self).__name__}(use_stateful_dataloader=True): torchdata's StatefulDataLoader is not used by "
                "fullshard; prepare the loader with accelerator.prepare (its state_dict restores the position)."
            )
        super().__init__(dataset, **kwargs)
        self.device, self.rng_types, self.synchronized_generator = device, rng_types, synchronized_generator
        self.skip_batches, self._drop_last, self._non_blocking = skip_batches, _drop_last, _non_blocking
        self.use_stateful_dataloader = False
        self.gradient_state = GradientState()
        self.iteration = iteration

    def _batches(self) -> Iterator[Any]:
        return DataLoader.__iter__(self)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self.begin()
        self.set_epoch(self.iteration)
        batches = self._batches()
        current = next(batches, _END)
        index = 0
        while current is not _END:
            if self.device is not None:
                current = send_to_device(current, self.device, non_blocking=self._non_blocking)
            following = next(batches, _END)
            if following is _END:
                self._mark_last()
            if index >= self.skip_batches:
                yield current
            index, current = index + 1, following
        self.iteration += 1
        self.end()

    def set_epoch(self, epoch: int) -> None:
        self.iteration = epoch
        _set_epoch_of_parts(self, epoch)

    @property
    def total_batch_size(self) -> int:
        sampler = self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler
        size = getattr(sampler, "batch_size", None) or 1
        return size if getattr(sampler, "split_batches", False) else size * getattr(sampler, "num_processes", 1)

    @property
    def total_dataset_length(self) -> int:
        return getattr(self.dataset, "total_length", None) or len(self.dataset)

    def _skipping(self, num_batches: int) -> DataLoaderShard:
        """This loader without the first ``num_batches`` of each epoch, at the same epoch (``skip_first_batches``)."""
        return type(self)(
            self.dataset,
            device=self.device,
            rng_types=self.rng_types,
            synchronized_generator=self.synchronized_generator,
            skip_batches=num_batches,
            _drop_last=self._drop_last,
            _non_blocking=self._non_blocking,
            iteration=self.iteration,
            **loader_kwargs(self),
        )


_END = object()


def _batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the first dimension of its first tensor (or its length)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return _batch_size(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (torch.Tensor, dict, list, tuple)):
        return _batch_size(batch[0])
    return len(batch)


def loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    """The arguments that rebuild ``loader``'s batching and workers."""
    names = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "generator", "persistent_workers")
    kwargs = {name: getattr(loader, name) for name in names}
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if isinstance(loader.dataset, IterableDataset):
        kwargs.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    else:
        kwargs["batch_sampler"] = loader.batch_sampler
    return kwargs


class DataLoaderDispatcher(DataLoaderShard):
    """The main process iterates the loader and sends every rank each round, which keeps its slice, as
    Accelerate's ``DataLoaderDispatcher``: a round is ``num_processes`` batches put end to end (one batch with
    ``split_batches``), and rank ``k`` keeps its ``k``-th ``1/num_processes`` of it. The last round may be short:
    unless ``_drop_last`` it is dispatched too, each rank keeping ``size // num_processes`` samples, and when
    that does not divide, the round is completed with the first ``num_processes`` samples of the epoch and each
    rank keeps one more. Only the main process reads the dataset; one process iterates as a plain loader."""

    def __init__(self, dataset: Any, split_batches: bool = False, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.split_batches = split_batches

    def _world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    @property
    def total_batch_size(self) -> int:
        """Samples per round over all ranks (the loader's batch size with ``split_batches``)."""
        size = self.batch_size or getattr(self.batch_sampler, "batch_size", None) or 1
        return size if self.split_batches else size * self._world()[0]

    def _rounds(self, n: int, rank: int) -> Iterator[Any]:
        """Every round (rank 0's batches put end to end), sent to all ranks."""
        source = DataLoader.__iter__(self) if rank == 0 else None
        wanted = 1 if self.split_batches else n
        while True:
            payload: list[Any] = [None]
            if rank == 0:
                got = [b for b in (next(source, _END) for _ in range(wanted)) if b is not _END]  # type: ignore[arg-type]
                if got and (len(got) == wanted or not self._drop_last):
                    payload = [concatenate(got)]
            dist.broadcast_object_list(payload, src=0)
            if payload[0] is None:
                return
            yield payload[0]

    def _batches(self) -> Iterator[Any]:
        n, rank = self._world()
        if n == 1:
            yield from DataLoader.__iter__(self)
            return
        rounds = self._rounds(n, rank)
        current, head = next(rounds, None), None
        while current is not None:
            following, batch = next(rounds, None), current
            if head is None:  # the epoch's first samples, to complete a last round that does not divide
                head = slice_tensors(batch, slice(0, n))
            size = _batch_size(batch)
            width = size // n
            if following is None and size % n and not self._drop_last:
                batch, width = concatenate([batch, head]), width + 1
            yield slice_tensors(batch, slice(rank * width, (rank + 1) * width))
            current = following

    def __len__(self) -> int:
        n, _ = self._world()
        whole = super().__len__()
        if self.split_batches or n == 1:
            return whole
        return whole // n if self._drop_last else math.ceil(whole / n)

    def _skipping(self, num_batches: int) -> DataLoaderDispatcher:
        return type(self)(
            self.dataset,
            split_batches=self.split_batches,
            skip_batches=num_batches,
            _drop_last=self._drop_last,
            iteration=self.iteration,
            **loader_kwargs(self),
        )


class SkipDataLoader(DataLoaderStateMixin, DataLoader):
    """A ``DataLoader`` without the first ``skip_batches`` batches of each epoch."""

    def __init__(self, dataset: Any, skip_batches: int = 0, use_stateful_dataloader: bool = False, **kwargs: Any):
        super().__init__(dataset, **kwargs)
        self.skip_batches = skip_batches
        self.use_stateful_dataloader = use_stateful_dataloader
        self.gradient_state = GradientState()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self.begin()
        for i, batch in enumerate(DataLoader.__iter__(self)):
            if i >= self.skip_batches:
                yield batch
        self.end()

    def __len__(self) -> int:
        return super().__len__() - self.skip_batches


def shard_loader(
    loader: DataLoader,
    *,
    num_processes: int,
    process_index: int,
    device: torch.device | None,
    split_batches: bool = False,
    even_batches: bool = True,
    non_blocking: bool = False,
    rng_types: Any = None,
) -> DataLoaderShard:
    """This rank's share of a loader that fullshard's index dealing does not take (an ``IterableDataset``, or a
    custom ``batch_sampler`` without a fixed ``batch_size``), dealt as Accelerate deals it: an
    :class:`IterableDatasetShard` or a :class:`BatchSamplerShard` inside a :class:`DataLoaderShard`."""
    kwargs = {k: v for k, v in loader_kwargs(loader).items() if k not in ("batch_sampler", "batch_size", "drop_last")}
    common = {"device": device, "rng_types": rng_types, "_drop_last": loader.drop_last, "_non_blocking": non_blocking}
    if isinstance(loader.dataset, IterableDataset):
        size = loader.batch_size
        dataset = loader.dataset
        if num_processes > 1 and _shards_natively(dataset, num_processes, split_batches):
            dataset = dataset.shard(num_shards=num_processes, index=process_index)
        elif num_processes > 1:
            dataset = IterableDatasetShard(
                loader.dataset, batch_size=size or 1, drop_last=loader.drop_last, num_processes=num_processes,
                process_index=process_index, split_batches=split_batches,
            )  # fmt: skip
            size = size // num_processes if (split_batches and size) else size
        return DataLoaderShard(dataset, batch_size=size, drop_last=loader.drop_last, **common, **kwargs)
    batch_sampler = loader.sampler if isinstance(loader.sampler, BatchSampler) else loader.batch_sampler
    shard = batch_sampler  # one process: the loader's own batches, as Accelerate keeps them
    if num_processes > 1:
        shard = BatchSamplerShard(batch_sampler, num_processes, process_index, split_batches, even_batches)
    return DataLoaderShard(loader.dataset, batch_sampler=shard, **common, **kwargs)


def dispatch_loader(
    loader: DataLoader, *, device: torch.device | None, split_batches: bool = False, non_blocking: bool = False
) -> DataLoaderDispatcher:
    """``loader`` dispatched (``dispatch_batches=True``): the main process iterates it and sends every rank its
    batch of each round (or its slice of each batch with ``split_batches``); see :class:`DataLoaderDispatcher`."""
    return DataLoaderDispatcher(
        loader.dataset, split_batches=split_batches, device=device, _drop_last=loader.drop_last,
        _non_blocking=non_blocking, **loader_kwargs(loader),
    )  # fmt: skip


def _shards_natively(dataset: Any, num_processes: int, split_batches: bool) -> bool:
    """A 🤗 ``datasets.IterableDataset`` with at least one file shard per process is split by its own ``shard``."""
    native = type(dataset).__module__.split(".")[0] == "datasets" and callable(getattr(dataset, "shard", None))
    return native and not split_batches and getattr(dataset, "n_shards", 0) >= num_processes


def dealt_as_accelerate(loader: DataLoader) -> bool:
    """Whether ``loader`` is one fullshard's index dealing cannot take (see ``sharded_loader.py``), so the Accelerator
    deals it with :func:`shard_loader`: a stream (``IterableDataset``) or a custom batch sampler
    (``batch_size=None``)."""
    return isinstance(loader.dataset, IterableDataset) or loader.batch_size is None

"""Dataloaders for ``Accelerator.prepare``: each rank iterates its share of every global batch.

[Note: batch dealing]
A prepared loader of batch size ``B`` on ``n`` ranks deals the original loader's batches round-robin, as
Accelerate does: at step ``s`` rank ``k`` gets batch ``s * n + k``. So the ``n`` batches of one step, taken in
rank order, are the contiguous global batch ``[s * n * B, (s + 1) * n * B)`` of the epoch's sample order, and
``gather`` of per-rank outputs lists the samples in that order. With ``split_batches=True`` the global batch is
the original batch (``B`` samples) and each rank gets ``B / n`` of it, in rank order.

- Sample order: see [Note: sample order] in ``sample_order.py`` (the same permutations as Accelerate).
- ``even_batches=True`` (default): when the last step has fewer than ``n * B`` samples, it is completed with
  samples from the start of the epoch, so every rank runs the same number of full batches (no rank waits in
  a collective the others never reach). :attr:`ShardedDataLoader.remainder` is the number of real samples in
  that last step; ``gather_for_metrics`` drops the rest.
- ``even_batches=False``: the batches are dealt as they are; the last ones may be short or missing on some ranks.
- ``drop_last=True``: the incomplete last step is dropped instead.

[Note: loader position]
The epoch counter, the sample order's state and the number of batches yielded in the epoch live in the
:class:`ShardBatchSampler`, which :func:`skip_first_batches` views share with their loader: whichever of them
is iterated, ``state_dict`` tells where the data stands. It holds the epoch to deal next and the order's state
that reproduces it (mid-epoch: the state the epoch started from, and the position; on the last batch or
between epochs: the next epoch's). ``load_state_dict`` restores the epoch and the order always, and the
position only when the loader was prepared with ``use_stateful_dataloader=True`` (Accelerate's semantics:
without it, a resumed script skips the batches it has seen with ``skip_first_batches``).

The position is saved as ``samples``: how many samples of the epoch's order the global batches dealt so far,
over all ranks (``position`` global batches of ``batch_size * num_processes`` samples each; in world-size-invariant
mode ``batch_size * G``, plus ``micro_batches_into_step`` of this rank's micro-batches when saved mid-step). It does
not depend on the number of ranks, so a checkpoint written on ``N`` ranks resumes on ``M``: the resumed epoch deals
the global batches of the order's samples from ``samples`` on, cut for ``M`` ranks, and completes the last one from
the start of the epoch as always. When ``samples`` is a multiple of the global batch (always, on the same number of
ranks, and in invariant mode, whose global batch does not depend on the number of ranks) these are exactly the
uninterrupted run's batches from ``position`` on. A mid-step position resumes only on the same ``G/N`` (with the
step's partial gradient sums, which ``save_state`` writes beside it; see ``state_io.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from fullshard.engine import micro_batches_per_rank
from fullshard.frontend.data.gradient_state import GradientState
from fullshard.frontend.data.loader_parts import DataLoaderShard
from fullshard.frontend.data.sample_order import SampleOrder, broadcast_from_rank0, make_sample_order
from fullshard.frontend.invariant import check_sampler, micro_batch_seed
from fullshard.frontend.ops import send_to_device

__all__ = [
    "GradientState",
    "ShardBatchSampler",
    "ShardedDataLoader",
    "prepare_data_loader",
    "skip_first_batches",
    "synchronize_rng_state",
    "synchronize_rng_states",
]

_END = object()
RNG_TYPES = ("generator", "torch", "cuda")
# DataLoader arguments a prepared loader inherits from the original (the batching ones are replaced).
_INHERITED = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
              "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")  # fmt: skip


class ShardBatchSampler:
    """The index lists rank ``rank`` of ``num_processes`` iterates in one epoch; see [Note: batch dealing].

    ``per_rank`` (world-size-invariant mode, see [Note: invariant training through the Accelerator] in
    ``invariant.py``; ``None``: the default dealing): a global batch is ``per_rank * num_processes`` batches, and
    each rank gets ``per_rank`` consecutive ones of it (rank ``i``: batches ``i * per_rank ..``), in order; the
    loader seeds each batch's randomness from ``micro_seed``.

    Also the loader's position (see [Note: loader position]): ``epoch`` (the epoch dealt next, or being
    dealt), ``start`` (samples of its order skipped when the iteration began, a multiple of the global batch in
    invariant mode) and ``position`` (this rank's batches since, the skipped micro-batches of a step resumed
    mid-way included), ``in_progress`` and ``at_last_batch``.
    """

    def __init__(
        self,
        sampler: Any,
        batch_size: int,
        num_processes: int,
        rank: int,
        *,
        drop_last: bool,
        even_batches: bool,
        order: SampleOrder | None = None,
        per_rank: int | None = None,
        micro_seed: int = 0,
    ) -> None:
        self.sampler, self.batch_size = sampler, batch_size
        self.num_processes, self.rank = num_processes, rank
        self.invariant, self.per_rank, self.micro_seed = per_rank is not None, per_rank or 1, micro_seed
        self.drop_last, self.even_batches = drop_last, even_batches
        self.order = order if order is not None else SampleOrder(sampler, "as_is")
        self.remainder = -1
        self.epoch = 0
        self.start = 0  # samples of the epoch's order dealt before this iteration began
        self.position = 0  # this rank's batches yielded (or skipped mid-step) by this iteration
        self.in_progress = False
        self.at_last_batch = False
        self.pending = (0, 0)  # (samples, micro-batches into a step) the next iteration skips: a restored position
        self._start_next = (0, 0)  # the same, for the iteration being started (set by the loader)

    @property
    def step_samples(self) -> int:
        """Samples per global batch (all ranks; in invariant mode ``batch_size * G``, whatever the world size)."""
        return self.batch_size * self.num_processes * self.per_rank

    def _global_batches(self, order: list[int], start: int = 0) -> list[list[int]]:
        """The global batches of ``order[start:]``; an incomplete last one is dropped or completed from the
        start of ``order`` (see [Note: batch dealing])."""
        step = self.step_samples
        rest = order[start:]
        full, extra = divmod(len(rest), step)
        self.remainder = extra if extra and self.even_batches and not self.drop_last else -1
        if self.drop_last or extra == 0:
            rest = rest[: full * step]
        elif self.even_batches:
            need = step - extra
            rest = rest + (order * (need // max(len(order), 1) + 1))[:need]
        return [rest[i : i + step] for i in range(0, len(rest), step)]

    def __iter__(self) -> Iterator[list[int]]:
        # A generator: the order is drawn at the first batch requested, after DataLoader drew its base seed
        # (from the same generator, when the DataLoader has one), as in Accelerate.
        (start, skip), self._start_next = self._start_next, (0, 0)
        b, a = self.batch_size, self.per_rank
        for i, global_batch in enumerate(self._global_batches(self.order.draw(self.epoch), start)):
            mine = global_batch[self.rank * a * b : (self.rank + 1) * a * b]
            for k in range(a):
                batch = mine[k * b : (k + 1) * b]
                if batch and i * a + k >= skip:
                    yield batch

    def __len__(self) -> int:
        n = len(self.sampler)
        step = self.batch_size * self.num_processes * self.per_rank
        full, extra = divmod(n, step)
        if self.drop_last or extra == 0:
            return full * self.per_rank
        if self.even_batches:
            return (full + 1) * self.per_rank
        mine = min(max(extra - self.rank * self.per_rank * self.batch_size, 0), self.per_rank * self.batch_size)
        return full * self.per_rank + -(-mine // self.batch_size)

    # --- world-size-invariant mode ([Note: invariant training through the Accelerator]) ----------------------

    def _in_epoch(self, position: int) -> int:
        """This rank's batch count from the epoch's start at ``position`` of this iteration."""
        return self.start // self.step_samples * self.per_rank + position

    def micro_batch_index(self, position: int) -> int:
        """The index within the epoch, in the global order, of the batch this rank yields at ``position``."""
        steps, k = divmod(self._in_epoch(position), self.per_rank)
        return (steps * self.num_processes + self.rank) * self.per_rank + k

    def seed_rng(self, position: int | None) -> tuple[int, int]:
        """Seed torch's global RNG for this rank's batch at ``position`` (``None``: the epoch's start); returns
        the batch's index within the epoch (``-1``) and the seed."""
        index = -1 if position is None else self.micro_batch_index(position)
        seed = micro_batch_seed(self.micro_seed, self.epoch, index)
        torch.manual_seed(seed)
        return index, seed

    def metric_rows(self, position: int) -> tuple[int, ...] | None:
        """Each rank's real samples in its batch at ``position`` when that batch belongs to a padded last global
        batch (see :attr:`remainder`), else ``None``."""
        position = self._in_epoch(position)
        if self.remainder <= 0 or position // self.per_rank != len(self) // self.per_rank - 1:
            return None
        k, b = position % self.per_rank, self.batch_size
        firsts = [(i * self.per_rank + k) * b for i in range(self.num_processes)]  # each rank's first sample
        return tuple(min(max(self.remainder - first, 0), b) for first in firsts)

    # --- position ([Note: loader position]) ---------------------------------------------------------

    def begin_epoch(self, skip_batches: int) -> None:
        """Start iterating the epoch: skip ``skip_batches`` of this rank's batches (a ``skip_first_batches`` view),
        else the restored position."""
        self.order.begin_epoch()
        if skip_batches:
            steps, within = divmod(skip_batches, self.per_rank)
            skip = (steps * self.step_samples, within)
        else:
            skip = self.pending
        self.pending = (0, 0)
        self._start_next = skip
        self.start, self.position = skip
        self.in_progress, self.at_last_batch = True, False

    def end_epoch(self) -> None:
        self.epoch += 1
        self.start, self.position, self.in_progress, self.at_last_batch = 0, 0, False, False

    def state_dict(self) -> dict[str, Any]:
        extra = {"per_rank": self.per_rank, "micro_batch_seed": self.micro_seed} if self.invariant else {}
        if self.in_progress and not self.at_last_batch:
            steps, within = divmod(self.position, self.per_rank)
            if self.invariant:
                extra["micro_batches_into_step"] = within
            samples = self.start + steps * self.step_samples
            return {"epoch": self.epoch, "samples": samples, **self.order.state_dict(at_epoch_start=True), **extra}
        epoch = self.epoch + (1 if self.in_progress else 0)
        return {"epoch": epoch, "samples": 0, **self.order.state_dict(at_epoch_start=False), **extra}

    def load_state_dict(self, state: dict[str, Any], *, restore_position: bool) -> None:
        self.order.load_state_dict(state)
        self.epoch = int(state["epoch"])
        if self.invariant and "micro_batch_seed" in state:
            self.micro_seed = int(state["micro_batch_seed"])
        if "samples" in state:
            samples, within = int(state["samples"]), int(state.get("micro_batches_into_step", 0))
        else:  # fullshard <= 0.2 saved this rank's batches ("batches_done" before 0.1), on the same world size
            samples, within = int(state.get("position", state.get("batches_done", 0))) * self.step_samples, 0
        saved_per_rank = int(state.get("per_rank", 1))
        if within and saved_per_rank != self.per_rank:  # saved mid-step in invariant mode on another world size
            raise ValueError(
                f"load_state: the data position was saved {within} micro-batches into a step of {saved_per_rank} "
                f"per rank; on a world size with {self.per_rank} per rank it can only resume at a step boundary. "
                "Save the state after optimizer.step() (outside accumulate())."
            )
        self.pending = (samples, within) if restore_position else (0, 0)
        self.start, self.position, self.in_progress, self.at_last_batch = 0, 0, False, False


def synchronize_rng_states(rng_types: tuple[str, ...] | list[str], generator: torch.Generator | None = None) -> None:
    """Give every rank rank 0's random states of ``rng_types`` (a collective; Accelerate's function).

    ``"generator"`` is ``generator``'s state (skipped when it is ``None``), ``"torch"`` the global torch RNG,
    ``"cuda"`` the current CUDA device's.
    """
    for kind in rng_types:
        if kind == "generator" and generator is not None:
            generator.set_state(broadcast_from_rank0(generator.get_state()))
        elif kind == "torch":
            torch.set_rng_state(broadcast_from_rank0(torch.get_rng_state()))
        elif kind == "cuda" and torch.cuda.is_available():
            torch.cuda.set_rng_state(broadcast_from_rank0(torch.cuda.get_rng_state()))


def synchronize_rng_state(rng_type: Any = None, generator: torch.Generator | None = None) -> None:
    """One kind of :func:`synchronize_rng_states` (``RNGType.TORCH``, ``CUDA`` or ``GENERATOR``, or its value)."""
    kind = str(getattr(rng_type, "value", rng_type))
    if kind not in RNG_TYPES or (kind == "generator" and generator is None):
        raise ValueError(
            f"synchronize_rng_state(rng_type={rng_type!r}): expected one of {', '.join(map(repr, RNG_TYPES))}, "
            "with generator=... for 'generator'."
        )
    synchronize_rng_states([kind], generator)


class ShardedDataLoader(DataLoaderShard):
    """A ``DataLoader`` over this rank's batches that moves them to ``device`` and reports the last batch.

    While the last batch is being processed ``end_of_dataloader`` (here and on ``gradient_state``) is ``True``
    and ``gradient_state.remainder`` says how many samples of the last global batch are real. ``skip_batches``
    (a :func:`skip_first_batches` view) skips that many batches of every epoch it iterates. It is a kind of
    Accelerate's ``DataLoaderShard`` (``isinstance`` holds, as for Accelerate's prepared loaders), dealt by
    :class:`ShardBatchSampler` instead.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        device: torch.device | None,
        gradient_state: GradientState,
        batch_sampler: ShardBatchSampler,
        split_batches: bool = False,
        non_blocking: bool = False,
        use_stateful_dataloader: bool = False,
        rng_types: tuple[str, ...] = ("generator",),
        skip_batches: int = 0,
        **kwargs: Any,
    ):
        DataLoader.__init__(self, dataset, batch_sampler=batch_sampler, **kwargs)  # not DataLoaderShard's dealing
        self.device = device
        self.gradient_state = gradient_state
        self.split_batches = split_batches
        self.non_blocking = non_blocking
        self.use_stateful_dataloader = use_stateful_dataloader
        self.rng_types = tuple(rng_types)
        self.skip_batches = skip_batches

    @property
    def remainder(self) -> int:
        return self.batch_sampler.remainder

    @property
    def synchronized_generator(self) -> torch.Generator | None:
        """The generator of the sample order, which every rank draws alike (Accelerate's name for it)."""
        return self.batch_sampler.order.generator

    _drop_last = property(lambda self: self.batch_sampler.drop_last)
    _non_blocking = property(lambda self: self.non_blocking)

    def reset(self) -> None:
        self.end_of_dataloader = False

    @property
    def iteration(self) -> int:
        """The epoch this loader deals next (Accelerate's ``DataLoaderShard.iteration``)."""
        return self.batch_sampler.epoch

    @property
    def total_batch_size(self) -> int:
        """Samples per step over all ranks (the original batch size with ``split_batches``)."""
        return self.batch_sampler.batch_size * self.batch_sampler.num_processes

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """Deal ``epoch`` next (with ``use_seedable_sampler`` its permutation is that of ``data_seed + epoch``)."""
        self.batch_sampler.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """Where the data stands (see [Note: loader position]); plain values and tensors only."""
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the epoch and the sample order; the position too with ``use_stateful_dataloader``."""
        self.batch_sampler.load_state_dict(state, restore_position=self.use_stateful_dataloader)

    def _forward_set_epoch(self, epoch: int) -> None:
        # As Accelerate: a sampler (or else a dataset) with set_epoch hears the epoch at each iteration.
        sampler = self.batch_sampler.sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        state, dealer = self.gradient_state, self.batch_sampler
        state.end_of_dataloader = self.end_of_dataloader = False
        synchronize_rng_states(self.rng_types, dealer.order.generator)
        dealer.begin_epoch(self.skip_batches)
        self._forward_set_epoch(dealer.epoch)
        if dealer.invariant:  # see [Note: invariant training through the Accelerator]
            dealer.seed_rng(None)
        resumed = (dealer.start or dealer.position) and self.generator is None
        iterator = self._resumed_iterator() if resumed else DataLoader.__iter__(self)
        current = next(iterator, _END)
        while current is not _END:
            upcoming = next(iterator, _END)
            if upcoming is _END:
                state.end_of_dataloader, state.remainder = True, self.remainder
                self.end_of_dataloader = True
                dealer.at_last_batch = True
            if dealer.invariant:  # this micro-batch's randomness, whatever the rank and world size
                state.metric_rows = dealer.metric_rows(dealer.position)
                index, seed = dealer.seed_rng(dealer.position)
                if state.caller_steps is not None:
                    state.caller_steps.record(index, seed)
            dealer.position += 1
            yield current if self.device is None else send_to_device(current, self.device, self.non_blocking)
            current = upcoming
        state.end_of_dataloader, state.metric_rows = False, None
        self.end_of_dataloader = False
        dealer.end_epoch()

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip_batches, 0)

    def _skipping(self, num_batches: int) -> ShardedDataLoader:
        """A view without the first ``num_batches`` of each epoch, sharing this loader's dealer
        (:func:`skip_first_batches`)."""
        return ShardedDataLoader(
            self.dataset,
            device=self.device,
            gradient_state=self.gradient_state,
            batch_sampler=self.batch_sampler,
            split_batches=self.split_batches,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
            rng_types=self.rng_types,
            skip_batches=num_batches,
            **_inherited_kwargs(self),
        )

    def _resumed_iterator(self) -> Iterator[Any]:
        """The DataLoader iterator of an epoch resumed part-way, without touching the global torch RNG.

        ``DataLoader.__iter__`` draws its workers' base seed from the global RNG. The uninterrupted run drew it
        at the start of the epoch, before the checkpoint whose RNG states ``load_state`` restored; a second draw
        here would shift every random number after the resume (dropout masks, ...). A private generator draws it.
        """
        self.generator = torch.Generator().manual_seed(self.batch_sampler.epoch)
        try:
            return DataLoader.__iter__(self)
        finally:
            self.generator = None


def _inherited_kwargs(loader: DataLoader) -> dict[str, Any]:
    return {k: getattr(loader, k) for k in _INHERITED if hasattr(loader, k)}


def _check_loader(
    loader: DataLoader, num_processes: int, split_batches: bool, micro_batches: int | None, even_batches: bool
) -> int:
    """This rank's batch size for ``loader`` (refusing what cannot be dealt)."""
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
    if micro_batches is not None:
        check_sampler(loader.sampler, micro_batches)
        return _invariant_batch_size(loader, micro_batches, split_batches, even_batches)
    if not split_batches:
        return loader.batch_size
    if loader.batch_size % num_processes:
        raise ValueError(
            f"Accelerator.prepare(dataloader) with split_batches=True: the DataLoader's batch_size "
            f"({loader.batch_size}) must be a multiple of the number of processes ({num_processes}). Use a "
            f"batch_size divisible by {num_processes}, or split_batches=False."
        )
    return loader.batch_size // num_processes


def _invariant_batch_size(loader: DataLoader, micro_batches: int, split_batches: bool, even_batches: bool) -> int:
    """The micro-batch size in world-size-invariant mode: ``batch_size``, or ``batch_size / G`` when it is the
    global batch (``split_batches``); see [Note: invariant training through the Accelerator]."""
    if not even_batches and not loader.drop_last:
        raise ValueError(
            f"Accelerator.prepare(dataloader) with even_batches=False and invariant_micro_batches={micro_batches}: "
            "every rank must run G/N micro-batches in every step, the last one too. Keep even_batches=True (the last "
            "global batch is completed from the epoch's start) or pass drop_last=True to the DataLoader."
        )
    if not split_batches:
        return loader.batch_size
    if loader.batch_size % micro_batches:
        raise ValueError(
            f"Accelerator.prepare(dataloader) with split_batches=True and invariant_micro_batches={micro_batches}: "
            f"the DataLoader's batch_size ({loader.batch_size}) is the global batch, cut into {micro_batches} "
            f"micro-batches, so it must be a multiple of {micro_batches}. Use such a batch_size, or "
            "split_batches=False (then batch_size is the micro-batch)."
        )
    return loader.batch_size // micro_batches


def prepare_data_loader(
    loader: DataLoader,
    *,
    num_processes: int,
    process_index: int,
    device: torch.device | None,
    gradient_state: GradientState,
    even_batches: bool = True,
    split_batches: bool = False,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    rng_types: tuple[str, ...] = ("generator",),
    invariant_micro_batches: int | None = None,
) -> ShardedDataLoader:
    """This rank's share of ``loader`` (see [Note: batch dealing]); the original loader is left unchanged.

    ``invariant_micro_batches=G``: dealt for world-size-invariant training, ``G / num_processes`` micro-batches
    per rank and step (see [Note: invariant training through the Accelerator] in ``invariant.py``).
    A collective when the sample order needs one (a seedable sampler's seed comes from rank 0), and in
    world-size-invariant mode (the base seed comes from rank 0).
    """
    micro_batches = invariant_micro_batches
    batch_size = _check_loader(loader, num_processes, split_batches, micro_batches, even_batches)
    order = make_sample_order(
        loader.sampler,
        num_processes=num_processes if micro_batches is None else max(num_processes, 2),  # N > 1's order on any N
        use_seedable_sampler=use_seedable_sampler,
        data_seed=data_seed,
    )
    invariant: dict[str, Any] = {}
    if micro_batches is not None:
        seed = data_seed if data_seed is not None else torch.initial_seed()
        seed = int(broadcast_from_rank0(torch.tensor([seed], dtype=torch.int64)).item())
        invariant = {"per_rank": micro_batches_per_rank(micro_batches, num_processes), "micro_seed": seed}
    batch_sampler = ShardBatchSampler(
        loader.sampler,
        batch_size,
        num_processes,
        process_index,
        drop_last=loader.drop_last,
        even_batches=even_batches,
        order=order,
        **invariant,
    )
    return ShardedDataLoader(
        loader.dataset,
        device=device,
        gradient_state=gradient_state,
        batch_sampler=batch_sampler,
        split_batches=split_batches,
        non_blocking=non_blocking,
        use_stateful_dataloader=use_stateful_dataloader,
        rng_types=rng_types,
        **_inherited_kwargs(loader),
    )


def skip_first_batches(loader: DataLoader, num_batches: int = 0) -> DataLoader:
    """``loader`` without the first ``num_batches`` batches of each epoch it is iterated for.

    For a prepared loader the result shares its epoch, sample order and position (see [Note: loader
    position]): iterate it for the epoch being resumed, then the prepared loader for the next ones.
    """
    if not isinstance(num_batches, int) or isinstance(num_batches, bool) or num_batches < 0:
        raise ValueError(f"skip_first_batches(num_batches={num_batches!r}): expected an int >= 0.")
    if callable(getattr(loader, "_skipping", None)):  # a prepared loader, Accelerate's DataLoaderShard / Dispatcher
        return loader._skipping(num_batches)
    if loader.batch_size is None or isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            f"skip_first_batches({type(loader).__name__}): only a prepared loader, or a DataLoader with a "
            "batch_size over a map-style dataset, can skip batches. Pass the loader accelerator.prepare returned."
        )
    return DataLoader(
        loader.dataset, batch_sampler=_SkipBatches(loader.batch_sampler, num_batches), **_inherited_kwargs(loader)
    )


class _SkipBatches:
    """A batch sampler without the first ``skip`` batches of ``batch_sampler``."""

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self) -> Iterator[list[int]]:
        for i, batch in enumerate(self.batch_sampler):
            if i >= self.skip:
                yield batch

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip, 0)

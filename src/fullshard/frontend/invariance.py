"""World-size-invariant training through the ``Accelerator``: the front end's part (the engine's: ``engine/invariant``).

[Note: invariant training through the Accelerator]
The engine makes the reduction and the clipping norm independent of the number of ranks ``N`` (see
[Note: world-size invariance] in ``engine/invariant.py``) provided every rank runs the right micro-batches and
each micro-batch computes the same thing on every ``N``. With ``FullyShardedDataParallelPlugin(
invariant_micro_batches=G)`` the Accelerator arranges that, so an ordinary Accelerate loop::

    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # or only when accelerator.sync_gradients
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

gives bitwise the same weights after every step on 1, 2, 4, ... ranks:

- **The batches.** The DataLoader's ``batch_size`` is the micro-batch (``split_batches=True``: the global batch,
  cut into ``G`` micro-batches of ``batch_size / G``); a global batch is ``G`` micro-batches, the same samples
  whatever ``N``: the epoch's sample order cut into consecutive global batches, each into ``G`` consecutive
  micro-batches. Data-parallel rank ``i`` gets micro-batches ``i*G/N .. (i+1)*G/N - 1`` of each global batch, in
  order. The sample order is drawn as on several processes even when ``N = 1`` (one generator seeded at
  ``prepare``; see [Note: sample order]), so it does not depend on ``N`` either. An incomplete last global batch
  is completed from the epoch's start (``even_batches``, the default; ``gather_for_metrics`` drops those samples
  again, rank by rank) or dropped (``drop_last``); ``even_batches=False`` is refused (ranks would run different
  numbers of micro-batches).
- **Accumulation.** ``gradient_accumulation_steps`` is set to ``G/N`` (passing another value than 1 or ``G/N``
  is refused), so ``accumulate()`` makes the optimizer step once per global batch, and ``backward`` divides the
  loss by ``G/N``, as the engine expects (it divides the tree's sum by ``N``: the loss is the mean over the ``G``
  micro-batches, normalised by the global batch). With ``G/N > 1``, ``backward`` outside ``accumulate()`` is
  refused: the optimizer would step on every micro-batch. The LR scheduler advances once per optimizer step (as
  with ``split_batches``; Accelerate's one-per-process would depend on ``N``).
- **Randomness.** Before it hands out a micro-batch, the prepared loader seeds torch's global RNG (CPU and every
  CUDA device, ``torch.manual_seed``) with :func:`micro_batch_seed` of (base seed, epoch, micro-batch index
  ``g`` within the epoch), and with ``(base seed, epoch, -1)`` at the start of each epoch: dropout and any other
  draw from the global RNG in the forward and backward are a function of the micro-batch, not of the rank. The
  base seed is ``DataLoaderConfiguration(data_seed=...)`` or else ``torch.initial_seed()`` of rank 0 at
  ``prepare`` (what ``set_seed`` set), and is saved in the loader's ``state_dict``. Draws from other generators
  (Python's ``random``, NumPy, a dataset's own transforms in loader workers) are not covered.
- **A loop that accumulates itself** (transformers' ``Trainer``): see [Note: the Trainer in invariant mode] below.
- **Resuming.** The loader's ``state_dict`` holds its position in samples and ``G/N``; a loader of another
  ``G/N`` converts a position saved at a step boundary (whole global batches done). A save part-way through a step
  also holds each rank's partial gradient sums and ``accumulate()``'s count (``step_in_progress_<rank>.pt``,
  ``state_io.py``): it resumes on the same ``G/N`` only, and is refused on another before anything is loaded.

[Note: the Trainer in invariant mode]
transformers' ``Trainer`` never enters ``accumulate()``. It creates the Accelerator with
``GradientAccumulationPlugin(num_steps=1)`` and accumulates itself: per optimizer step it fetches
``TrainingArguments.gradient_accumulation_steps`` batches from the prepared loader at once
(``get_batch_samples``), then for each calls ``gradient_state._set_sync_gradients(last)``, runs forward and
``accelerator.backward`` (inside ``accelerator.no_sync(model)`` for all but the last), and on the last clips,
steps the optimizer and the scheduler (its own, not prepared: one step per optimizer step). It scales the loss
itself: by ``num_items_in_batch``, the label tokens of the whole global batch (each rank's count, gathered and
summed when ``average_tokens_across_devices``, the default) times ``num_processes``; or, when the model takes no
loss kwargs, the micro-batch's mean divided by its accumulation steps. Either way the per-micro-batch loss is the
default mode's, and the engine's tree sum divided by ``N`` gives the mean over the global batch; only powers of
two depend on ``N``, so every rounding scales exactly. What the front end adds (:class:`CallerSteps`, called from
``_set_sync_gradients``, the Accelerate API only such loops use):

- ``backward`` outside ``accumulate()`` is allowed once the loop announces its micro-batches this way, and divides
  the loss by the ``gradient_accumulation_steps`` the Accelerator was created with (1 for the Trainer, which has
  scaled it), not by ``G/N``, as Accelerate does;
- the loop must step every ``G/N`` micro-batches: a sync announced after another count is refused, naming
  ``gradient_accumulation_steps=G/N`` (the engine reduces every ``G/N`` backward passes);
- the Trainer runs its micro-batches after fetching all of them, so the seed the loader set when it yielded a
  micro-batch has been replaced by the next one's, and the forwards draw one after another from the last one's
  stream. ``_set_sync_gradients`` for the ``k``-th micro-batch of a step seeds torch's global RNG again with the
  seed of the latest micro-batch yielded whose index within its step is ``k`` (the ``k``-th fetched), so
  dropout is a function of the micro-batch again, whether the loop fetches ahead or one at a time.

The sample order needs nothing: the Trainer's ``RandomSampler`` (or ``SequentialSampler``) is drawn by the
prepared loader as for any loop. Its ``LengthGroupedSampler`` (``train_sampling_strategy="group_by_length"``)
groups megabatches of ``per_device_train_batch_size * gradient_accumulation_steps`` samples, which depends on
``N``, and is refused.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fullshard.frontend import ops

__all__ = ["CallerSteps", "InvariantRun", "check_sampler", "configure", "keep_rows", "micro_batch_seed"]


@dataclass(frozen=True)
class InvariantRun:
    """``G`` micro-batches per step over ``data_parallel_size`` ranks: ``per_rank = G / N`` each."""

    micro_batches: int
    data_parallel_size: int
    requested_steps: int = 1  # the Accelerator's gradient_accumulation_steps as given: 1 (the default) or G/N

    @property
    def per_rank(self) -> int:
        return self.micro_batches // self.data_parallel_size


def configure(micro_batches: int | None, data_parallel_size: int, accumulation_steps: int) -> InvariantRun | None:
    """The run of ``FullyShardedDataParallelPlugin(invariant_micro_batches=G)`` on ``N`` data-parallel ranks
    (``None``: the default mode); refuses a ``G`` that ``N`` does not divide and an accumulation count other
    than 1 (the default, replaced by ``G/N``) or ``G/N``."""
    if micro_batches is None:
        return None
    run = InvariantRun(micro_batches, data_parallel_size, accumulation_steps)
    if micro_batches % data_parallel_size:
        raise ValueError(
            f"Accelerator: FullyShardedDataParallelPlugin.invariant_micro_batches={micro_batches} is not a multiple "
            f"of the data-parallel size {data_parallel_size}: each rank runs G/N micro-batches per step. Run on a "
            f"number of ranks that divides {micro_batches}, or pick G as a multiple of every world size (a power of "
            "two)."
        )
    if accumulation_steps not in (1, run.per_rank):
        raise ValueError(
            f"Accelerator(gradient_accumulation_steps={accumulation_steps}) with invariant_micro_batches="
            f"{micro_batches} on {data_parallel_size} data-parallel ranks: world-size-invariant mode accumulates "
            f"G/N = {run.per_rank} micro-batches per rank and sets gradient_accumulation_steps to that itself. Leave "
            "it at 1 (the default), or drop invariant_micro_batches."
        )
    return run


def micro_batch_seed(base: int, epoch: int, index: int) -> int:
    """The seed of micro-batch ``index`` of ``epoch`` (``-1``: the epoch's start), from the run's ``base`` seed:
    a hash, so neighbouring micro-batches get unrelated streams; the same on every rank and world size."""
    digest = hashlib.blake2b(f"{base}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def keep_rows(data: Any, rows: Sequence[int], *, objects: bool) -> Any:
    """Of ``data`` gathered over ranks (each tensor's dim 0, or the list of objects, holding every rank's batch in
    rank order), the first ``rows[i]`` items of rank ``i``'s part: the real samples of a padded last global batch,
    for ``gather_for_metrics``."""

    def pick(items: Any) -> Any:
        per = len(items) // len(rows)
        parts = [items[i * per : i * per + min(r, per)] for i, r in enumerate(rows)]
        return [x for part in parts for x in part] if objects else torch.cat(parts)

    return pick(data) if objects else ops.recursively_apply(pick, data)


@dataclass
class CallerSteps:
    """The micro-batches of a loop that accumulates itself and announces each with ``_set_sync_gradients``; see
    [Note: the Trainer in invariant mode].

    ``yielded``: ``(index within the epoch, seed)`` of the latest micro-batches the prepared loaders yielded;
    ``count``: micro-batches announced in the step in progress; ``active``: the loop has announced one."""

    run: InvariantRun
    yielded: collections.deque[tuple[int, int]] = field(init=False)
    count: int = 0
    active: bool = False

    def __post_init__(self) -> None:
        self.yielded = collections.deque(maxlen=2 * self.run.per_rank)

    def record(self, index: int, seed: int) -> None:
        """A prepared loader yielded micro-batch ``index`` of its epoch, whose randomness is seeded by ``seed``."""
        self.yielded.append((index, seed))

    def announce(self, sync: bool) -> None:
        """The loop is about to run its next micro-batch, the step's last when ``sync``: refuse a step of another
        length than ``G/N``, and seed torch's global RNG with that micro-batch's seed."""
        run, k = self.run, self.count
        if sync != (k + 1 == run.per_rank):
            ran = f"{k + 1} micro-batch{'es' if k else ''}" if sync else f"more than {run.per_rank} micro-batches"
            raise ValueError(
                f"world-size-invariant mode (invariant_micro_batches={run.micro_batches} on {run.data_parallel_size} "
                f"data-parallel ranks) runs G/N = {run.per_rank} micro-batches per rank and optimizer step, but the "
                f"training loop steps after {ran}. transformers' Trainer: set TrainingArguments("
                f"gradient_accumulation_steps={run.per_rank}), i.e. G // WORLD_SIZE (per_device_train_batch_size is "
                "the micro-batch; a global batch is G of them on any number of ranks)."
            )
        self.active, self.count = True, 0 if sync else k + 1
        seed = next((s for index, s in reversed(self.yielded) if index % run.per_rank == k), None)
        if seed is None:
            raise RuntimeError(
                f"world-size-invariant mode: micro-batch {k} of the step was announced (_set_sync_gradients) but no "
                "prepared loader yielded it: run the micro-batches of the loader accelerator.prepare returned."
            )
        torch.manual_seed(seed)


def check_sampler(sampler: object, micro_batches: int) -> None:
    """Refuse a sampler whose order depends on the number of ranks (transformers' ``LengthGroupedSampler``)."""
    if type(sampler).__name__ == "LengthGroupedSampler":
        raise ValueError(
            f"Accelerator.prepare(dataloader) with invariant_micro_batches={micro_batches}: transformers' "
            "LengthGroupedSampler (TrainingArguments(train_sampling_strategy='group_by_length')) groups megabatches of "
            "per_device_train_batch_size * gradient_accumulation_steps samples, which depends on the number of ranks, "
            "so the sample order would too. Use train_sampling_strategy='random' (the default) or 'sequential'."
        )

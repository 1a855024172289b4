"""World-size-invariant mode through the ``Accelerator``: the front end's part of it, all here (the engine's:
``engine/invariant.py``, reached through ``fullshard.engine``'s surface only). The run's ``G`` and ``G/N``
(:func:`configure`), the loss division and what ``backward`` refuses (:func:`loss_divisor`), a loop that accumulates
itself (:class:`CallerSteps`), each micro-batch's seed, a padded last global batch's rows, and a step saved or
loaded part-way (:func:`step_to_save`, :func:`check_step_to_save`, :func:`check_step_to_load`, :func:`restore_step`).

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
  ``saving/state_io.py``): it resumes on the same ``G/N`` only, and is refused on another before anything is loaded.

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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.checkpoint import load_small_file, step_in_progress_file_name
from fullshard.engine import (
    invariant_micro_batches,
    invariant_per_rank,
    micro_batches_per_rank,
    pending_micro_batches,
    restore_step_in_progress,
    step_in_progress,
)
from fullshard.frontend import ops

__all__ = [
    "CallerSteps",
    "InvariantRun",
    "check_sampler",
    "check_step_to_load",
    "check_step_to_save",
    "configure",
    "invariant_mode",
    "keep_rows",
    "loss_divisor",
    "micro_batch_seed",
    "restore_step",
    "step_to_save",
]


@dataclass(frozen=True)
class InvariantRun:
    """``G`` micro-batches per step over ``data_parallel_size`` ranks: ``per_rank = G / N`` each."""

    micro_batches: int
    data_parallel_size: int
    requested_steps: int = 1  # the Accelerator's gradient_accumulation_steps as given: 1 (the default) or G/N

    @property
    def per_rank(self) -> int:
        return micro_batches_per_rank(self.micro_batches, self.data_parallel_size)


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


def loss_divisor(run: InvariantRun | None, steps: int, accumulating: bool, caller: CallerSteps | None) -> int:
    """What ``Accelerator.backward`` divides the loss by: ``steps`` (its ``gradient_accumulation_steps``, ``G/N`` in
    world-size-invariant mode), or, in a loop that announces its micro-batches itself (``caller`` active, outside
    ``accumulate()``), the steps the Accelerator was created with (see [Note: the Trainer in invariant mode]).
    Refuses ``backward`` outside ``accumulate()`` in any other loop when ``G/N > 1``."""
    if run is None or accumulating:
        return steps
    if caller is not None and caller.active:
        return run.requested_steps  # the loop accumulates itself, as in Accelerate
    if run.per_rank > 1:
        raise RuntimeError(
            f"Accelerator.backward outside accumulate() in world-size-invariant mode (invariant_micro_batches="
            f"{run.micro_batches} on {run.data_parallel_size} ranks: {run.per_rank} micro-batches per rank and "
            "step): the optimizer would step on every micro-batch. Run each batch inside "
            "`with accelerator.accumulate(model):` (transformers' Trainer, which accumulates itself, is "
            "supported: see docs/accelerate.md)."
        )
    return steps


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


# --- a step saved part-way: save_state / load_state (saving/state_io.py) call these -----------------------------------


def invariant_mode(model: nn.Module) -> bool:
    """Whether ``model`` is sharded in world-size-invariant mode (``invariant_micro_batches``)."""
    return invariant_micro_batches(model) is not None


def step_to_save(models: list[nn.Module]) -> dict[str, Any] | None:
    """World-size-invariant mode saved part-way through a step (micro-batches folded, not reduced): this rank's
    partial gradient sums per model (see ``engine/invariant.py``), and how many micro-batches of how many;
    ``None`` at a step boundary or in the default mode."""
    sums = [step_in_progress(m) if invariant_mode(m) else None for m in models]
    counts = {e["count"] for saved in sums if saved is not None for e in saved if e["count"]}
    if not counts:
        return None
    per_rank = next((n for m in models if (n := invariant_per_rank(m)) is not None), 0)
    return {"micro_batches": max(counts), "per_rank": per_rank, "models": sums}


def check_step_to_save(models: list[nn.Module], gradient_state: Any, where: str) -> None:
    """Refuse a world-size-invariant save made part-way through a step that could not resume as this run goes on:
    ``accumulate()`` counted another number of this step's micro-batches than the units folded (saved after
    ``accumulate()`` was entered and before its ``backward``)."""
    models = [m for m in models if invariant_mode(m)]
    if not models or gradient_state is None:
        return
    folded = max(pending_micro_batches(m) for m in models)
    counted = gradient_state.step % gradient_state.num_steps
    if counted != folded:
        raise ValueError(
            f"{where}: world-size-invariant mode, part-way through a step: accumulate() counted {counted} "
            f"micro-batches of this step but {folded} went through backward, so the resumed run would not finish the "
            "step as this one does. Call save_state after accelerator.backward (inside or after `with "
            "accelerator.accumulate(model):`), or at a step boundary (after optimizer.step())."
        )


def check_step_to_load(folder: Path, saved: int, models: list[nn.Module], where: str) -> None:
    """Refuse, before anything is loaded, a checkpoint saved part-way through a world-size-invariant step on
    another number of processes (``saved``, not this run's: its partial sums are per rank of that layout), or into
    a model that is not in world-size-invariant mode. The same answer on every rank: rank 0's file decides."""
    first = folder / step_in_progress_file_name(0)
    if not first.is_file():
        return
    world = dist.get_world_size()
    if saved == world and models and all(invariant_mode(m) for m in models):
        return
    step = load_small_file(first)
    done, per_rank = int(step["micro_batches"]), int(step["per_rank"])
    if saved != world:
        raise ValueError(
            f"{where}: the checkpoint was saved {done} micro-batches into a step of {per_rank} per rank, on {saved} "
            f"processes in world-size-invariant mode; those micro-batches' gradients are partial sums of that "
            f"layout, so it resumes only on {saved} processes, not {world}. Resume it on {saved} processes (then "
            "save again at a step boundary), or save the state after optimizer.step() (outside accumulate(), when "
            "accelerator.sync_gradients is True) to resume on any number."
        )
    raise ValueError(
        f"{where}: the checkpoint was saved {done} micro-batches into a world-size-invariant step, but the models "
        "are not all in world-size-invariant mode, which would drop those micro-batches' gradients. Prepare them "
        "with the same FullyShardedDataParallelPlugin(invariant_micro_batches=...) as the run that saved it."
    )


def restore_step(models: list[nn.Module], gradient_state: Any, step: dict[str, Any] | None, where: str) -> None:
    """Put back the partial gradient sums and the accumulation count of a step saved part-way (``step``), or start
    every world-size-invariant model at a step boundary (``None``)."""
    saved = step["models"] if step is not None else [None] * len(models)
    invariant_models = [(m, s) for m, s in zip(models, saved, strict=True) if invariant_mode(m)]
    for model, sums in invariant_models:
        restore_step_in_progress(model, sums, where)
    if invariant_models and gradient_state is not None:
        gradient_state.step = int(step["micro_batches"]) if step is not None else 0

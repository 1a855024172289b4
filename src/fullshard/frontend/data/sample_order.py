"""The order in which a prepared loader visits the samples in each epoch, the same as Accelerate's for a seed.

[Note: sample order]
Which permutation an epoch deals depends on the loader's sampler and the dataloader configuration, exactly as
in Accelerate (so a script moved from it sees the same batches on the same ranks):

- ``RandomSampler`` on several processes (the default): one ``torch.Generator`` shuffles every epoch and
  continues from epoch to epoch. It is the sampler's own generator when the ``DataLoader`` was given one;
  otherwise a new one, seeded at ``prepare`` by one draw from each rank's global torch RNG. At the start of
  every epoch rank 0's generator state is broadcast to the others (with ``rng_types`` containing
  ``"generator"``, the default), so every rank draws the same permutation.
- ``use_seedable_sampler=True``: epoch ``e`` deals the permutation of the seed ``data_seed + e`` (``data_seed``
  defaults to ``torch.initial_seed()``, taken from rank 0), on any number of processes.
- ``RandomSampler`` without a generator on one process: the sampler is used as it is, so each epoch's
  permutation is drawn from the global torch RNG (whose state ``load_state`` restores).
- Any other sampler is iterated as it is.

A checkpoint resumes on another number of processes (``load_state_dict``), with the order the saving run would
have dealt: a one-process loader given a shuffling generator's state takes that generator on; a loader on several
processes given a one-process run's epoch in progress (the state of the generator ``RandomSampler`` seeded from the
global RNG for it, ``epoch_generator``) deals that epoch from it, then goes on with that generator.

The permutation is drawn by iterating a copy of the user's sampler that holds the generator, so samplers with
replacement or ``num_samples`` draw what they would in Accelerate, and the user's ``DataLoader`` is not changed.

For checkpoints, :meth:`SampleOrder.state_dict` gives what reproduces an epoch: the generator state as it was
at the start of the epoch in progress (``at_epoch_start=True``), or as it is now (for the next epoch); on one
process without a generator, the state of the generator the epoch in progress was drawn with (``epoch_generator``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import RandomSampler

__all__ = ["SampleOrder", "broadcast_from_rank0", "make_sample_order"]


def broadcast_from_rank0(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``tensor`` on every rank (a collective; NCCL needs it on the GPU)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return tensor
    on_gpu = "nccl" in str(dist.get_backend())
    moved = tensor.cuda() if on_gpu else tensor.clone()
    dist.broadcast(moved, src=0)
    return moved.cpu() if on_gpu else moved


class SampleOrder:
    """Draws each epoch's sample order; see [Note: sample order].

    ``mode`` is ``"generator"`` (one generator continued across epochs), ``"seedable"`` (seed + epoch),
    ``"global"`` (a ``RandomSampler`` drawing from the global torch RNG, on one process) or ``"as_is"`` (any other
    sampler, iterated unchanged). ``generator`` is the generator to keep in step across ranks (``None`` unless
    ``mode == "generator"``).
    """

    def __init__(self, sampler: Any, mode: str, generator: torch.Generator | None = None, seed: int = 0) -> None:
        self.mode = mode
        self.generator = generator
        self.seed = seed
        self._epoch_start: torch.Tensor | None = None
        self._resume_from: torch.Tensor | None = None  # "global": the generator state the next epoch is drawn from
        if mode in ("as_is", "global"):
            self.sampler = sampler
        else:
            self.sampler = copy.copy(sampler)
            self.sampler.generator = generator if mode == "generator" else torch.Generator()

    def begin_epoch(self) -> None:
        """Remember the generator state this epoch starts from (before anything draws from it)."""
        self._epoch_start = self.generator.get_state() if self.mode == "generator" else None

    def draw(self, epoch: int) -> list[int]:
        """The sample indices of ``epoch``, in order (advances the generator in ``"generator"`` mode)."""
        if self.mode == "seedable":
            self.sampler.generator.manual_seed(self.seed + epoch)
        if self.mode == "global":
            return self._draw_global()
        return list(iter(self.sampler))

    def _draw_global(self) -> list[int]:
        """What ``RandomSampler`` without a generator draws (a seed from the global RNG, then a generator of that
        seed), keeping the generator's state; a resumed epoch uses the saved state and leaves the global RNG alone
        (``load_state`` restored it as it was after the uninterrupted run's draw)."""
        generator = torch.Generator()
        if self._resume_from is not None:
            generator.set_state(self._resume_from)
            self._resume_from = None
        else:  # RandomSampler.__iter__'s own draw (torch 2.x)
            generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        self._epoch_start = generator.get_state()
        sampler = copy.copy(self.sampler)
        sampler.generator = generator
        return list(iter(sampler))

    def state_dict(self, at_epoch_start: bool) -> dict[str, Any]:
        if self.mode == "generator":
            start = self._epoch_start if at_epoch_start and self._epoch_start is not None else None
            return {"generator": start if start is not None else self.generator.get_state()}
        if self.mode == "seedable":
            return {"data_seed": self.seed}
        if self.mode == "global" and at_epoch_start and self._epoch_start is not None:
            return {"epoch_generator": self._epoch_start}
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the order of ``state``, also one saved on another number of processes (see [Note: sample order])."""
        if self.mode == "global" and "generator" in state:  # saved on several processes: continue their generator
            self.mode, self.generator = "generator", torch.Generator()
            self.sampler = copy.copy(self.sampler)
            self.sampler.generator = self.generator
        if self.mode == "generator" and ("generator" in state or "epoch_generator" in state):
            self.generator.set_state(state.get("generator", state.get("epoch_generator")))
        elif self.mode == "global" and "epoch_generator" in state:
            self._resume_from = state["epoch_generator"]
        elif self.mode == "seedable" and "data_seed" in state:
            self.seed = int(state["data_seed"])


def make_sample_order(
    sampler: Any, *, num_processes: int, use_seedable_sampler: bool, data_seed: int | None
) -> SampleOrder:
    """The order source Accelerate would use for ``sampler`` (called on every rank at ``prepare``)."""
    if not isinstance(sampler, RandomSampler):
        return SampleOrder(sampler, "as_is")
    if use_seedable_sampler:
        seed = data_seed if data_seed is not None else torch.initial_seed()
        seed = int(broadcast_from_rank0(torch.tensor([seed], dtype=torch.int64)).item())
        return SampleOrder(sampler, "seedable", seed=seed)
    generator = sampler.generator
    if generator is None:
        if num_processes == 1:
            return SampleOrder(sampler, "global")
        generator = torch.Generator()
        # One draw from the global RNG, as Accelerate makes at prepare (later random numbers stay in step).
        generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
    return SampleOrder(sampler, "generator", generator=generator)

"""Prepared dataloaders on 2 gloo ranks: the sample order of every epoch, and what a checkpoint restores.

Set up: a shuffled DataLoader of 22 indices, batch 3 per rank, prepared by ``prepare_data_loader`` as the
Accelerator does (every rank seeds its global RNG alike, as ``set_seed`` does).
Run: epochs straight through; loaders restored from ``state_dict`` taken mid-epoch, on the last batch and
between epochs, with and without ``use_stateful_dataloader``; ``skip_first_batches`` views.
Check: every epoch deals each sample once over the ranks and reshuffles; a restored loader deals the batches
the uninterrupted one dealt (the position only when stateful); with the seedable sampler epoch ``e`` is the
permutation of ``data_seed + e`` on every rank (from rank 0's seed), also for a fresh loader resuming a later
epoch as transformers' Trainer does (``skip_first_batches``, then ``set_epoch``); ``split_batches`` cuts the
original batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from fullshard.frontend.data.sharded_loader import GradientState, prepare_data_loader, skip_first_batches
from fullshard.testing import WorkerPool

N, BATCH = 22, 3


def prepared(rank: int, world: int, **kwargs: Any):  # type: ignore[no-untyped-def]
    torch.manual_seed(kwargs.pop("seed", 0))
    loader = DataLoader(list(range(N)), batch_size=kwargs.pop("batch_size", BATCH), shuffle=True)
    return prepare_data_loader(
        loader, num_processes=world, process_index=rank, device=None, gradient_state=GradientState(), **kwargs
    )


def epoch(loader) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [batch.tolist() for batch in loader]


def straight_and_restored(rank: int, world: int, stateful: bool) -> dict[str, Any]:
    """Three epochs straight; then a fresh loader restored from the state taken after 2 batches of epoch 1."""
    loader = prepared(rank, world, use_stateful_dataloader=stateful)
    straight, states = [], {}
    for e in range(3):
        batches = []
        for i, batch in enumerate(loader):
            batches.append(batch.tolist())
            if e == 1 and i == 1:
                states["mid"] = loader.state_dict()
            if e == 1 and i == len(loader) - 1:
                states["last"] = loader.state_dict()
        straight.append(batches)
        if e == 0:
            states["between"] = loader.state_dict()
    out: dict[str, Any] = {"straight": straight, "states": {k: dict(v, generator=None) for k, v in states.items()}}
    for name, state in states.items():
        fresh = prepared(rank, world, seed=123, use_stateful_dataloader=stateful)  # another seed: state decides
        fresh.load_state_dict(state)
        out[name] = [epoch(fresh), epoch(fresh)]
    resumed = prepared(rank, world, seed=123, use_stateful_dataloader=stateful)
    resumed.load_state_dict(states["mid"])
    out["skipped"] = [epoch(skip_first_batches(resumed, 2)), epoch(resumed)]
    return out


def test_restored_position_only_with_the_stateful_loader(pool2: WorkerPool) -> None:
    for stateful in (False, True):
        for rank, out in enumerate(pool2.run(straight_and_restored, stateful)):
            straight = out["straight"]
            # the position in samples of the epoch's order, over all ranks: 2 steps of 2 ranks x 3
            assert out["states"]["mid"] == {"epoch": 1, "samples": 2 * 2 * BATCH, "generator": None}
            assert out["states"]["last"] == {"epoch": 2, "samples": 0, "generator": None}
            assert out["states"]["between"] == {"epoch": 1, "samples": 0, "generator": None}
            mid_expected = straight[1][2:] if stateful else straight[1]
            assert out["mid"] == [mid_expected, straight[2]], (rank, stateful)
            assert out["last"][0] == straight[2] and out["between"][0] == straight[1]
            # The idiom of Accelerate's checkpointing example (skip_first_batches, then the loader itself) works
            # without the stateful loader; with it, the restored position is replaced by the skip, not added to it.
            assert out["skipped"] == [straight[1][2:], straight[2]]
    ranks = pool2.run(straight_and_restored, False)
    for e in range(3):
        dealt = sorted(i for r in ranks for batch in r["straight"][e] for i in batch)
        assert sorted(set(dealt)) == list(range(N)) and len(dealt) == 24  # 22 samples + 2 repeated (even_batches)
    assert ranks[0]["straight"][0] != ranks[0]["straight"][1], "each epoch reshuffles"


def seedable_epochs(rank: int, world: int) -> list[Any]:
    torch.manual_seed(rank)  # unlike set_seed, the ranks' RNGs differ: the seed still comes from rank 0
    loader = prepared(rank, world, seed=rank, use_seedable_sampler=True, data_seed=42)
    epochs = [epoch(loader), epoch(loader)]
    loader.set_epoch(5)
    epochs.append(epoch(loader))
    return epochs


def test_seedable_sampler_deals_seed_plus_epoch(pool2: WorkerPool) -> None:
    ranks = pool2.run(
        seedable_epochs,
    )
    for e, seed_epoch in ((0, 0), (1, 1), (2, 5)):
        permutation = list(RandomSampler(range(N), generator=torch.Generator().manual_seed(42 + seed_epoch)))
        permutation += permutation[: 24 - N]
        dealt = [i for step in zip(ranks[0][e], ranks[1][e], strict=True) for batch in step for i in batch]
        assert dealt == permutation


def trainer_resume(rank: int, world: int, seedable: bool) -> dict[str, Any]:
    """Four epochs straight, each after ``set_epoch``; then transformers' Trainer resuming 2 batches into epoch 2:
    a fresh loader (the same seed, nothing restored), ``skip_first_batches`` then ``set_epoch(2)`` on the view,
    then ``set_epoch(3)`` on the loader."""
    loader = prepared(rank, world, use_seedable_sampler=seedable)
    straight = []
    for e in range(4):
        loader.set_epoch(e)
        straight.append(epoch(loader))
    fresh = prepared(rank, world, use_seedable_sampler=seedable)
    view = skip_first_batches(fresh, 2)
    view.set_epoch(2)
    resumed = [epoch(view)]
    fresh.set_epoch(3)
    resumed.append(epoch(fresh))
    return {"straight": straight, "resumed": resumed}


def test_trainer_resume_into_a_later_epoch_deals_its_order_with_the_seedable_sampler(pool2: WorkerPool) -> None:
    # - Run: the seedable sampler (the Trainer's default), then the one generator (use_seedable_sampler=False)
    seedable = pool2.run(trainer_resume, True)
    generator = pool2.run(trainer_resume, False)
    # - Check: epoch e is the permutation of seed + e, however many epochs this loader dealt; with one generator
    #   the fresh loader deals its first permutation, as Accelerate's does (it does not save that generator), so
    #   a Trainer resumed in a later epoch sees other batches (load_state restores it: see the test above)
    for rank in range(2):
        straight = seedable[rank]["straight"]
        assert seedable[rank]["resumed"] == [straight[2][2:], straight[3]], rank
        straight = generator[rank]["straight"]
        assert generator[rank]["resumed"] == [straight[0][2:], straight[1]], rank
        assert straight[0] != straight[2]


def split_epoch(rank: int, world: int) -> list[list[int]]:
    loader = prepared(rank, world, split_batches=True, batch_size=4)
    assert loader.total_batch_size == 4
    return epoch(loader)


def test_split_batches_cut_the_original_batch(pool2: WorkerPool) -> None:
    r0, r1 = pool2.run(split_epoch)
    assert len(r0) == len(r1) == 6 and all(len(b) == 2 for b in r0 + r1)
    assert {i for b in r0 + r1 for i in b} == set(range(N))  # 22 samples in 6 steps of 4 (2 repeated)

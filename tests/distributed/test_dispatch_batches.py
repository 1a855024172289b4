"""``dispatch_batches=True`` through the Accelerator on 2 gloo ranks, against Accelerate 1.15's own dispatcher.

Set up: a map-style dataset that only rank 0 may read (any other rank's read raises), in a ``DataLoader`` of
batch 4 (10 and 9 samples: a short last round that divides by the ranks and one that does not; also 16 with
``drop_last`` and with ``split_batches``); ``Accelerator(dataloader_config=DataLoaderConfiguration(
dispatch_batches=True, ...))`` prepares it. The reference wraps the same loader in Accelerate's
``DataLoaderDispatcher`` on the same ranks.
Check: two epochs give each rank the batches Accelerate's dispatcher gives it, with the same length, the last
batch flagged (``end_of_dataloader``); ``skip_first_batches`` skips whole rounds; a pickled Accelerator's loader
deals the same; world-size-invariant mode refuses dispatching by name.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from fullshard import Accelerator, DataLoaderConfiguration, FullyShardedDataParallelPlugin
from fullshard.frontend.data.loader_parts import DataLoaderDispatcher
from fullshard.testing import WorkerPool


class RankZeroOnly(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if dist.get_rank() != 0:
            raise RuntimeError(f"rank {dist.get_rank()} read sample {i}: only rank 0 reads under dispatch_batches")
        return torch.tensor([i, 10 * i])


def _epochs(loader: Any) -> list[Any]:
    out = []
    for _ in range(2):
        epoch = []
        for batch in loader:
            epoch.append((batch.tolist(), bool(loader.end_of_dataloader)))
        out.append(epoch)
    return [len(loader), out]


def _accelerate_reference(rank: int, world: int, n: int, drop_last: bool, split: bool) -> list[Any]:
    saved = dict(os.environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        from accelerate.data_loader import DataLoaderDispatcher as AccelerateDispatcher
        from accelerate.state import PartialState

        PartialState(cpu=True)
        loader = DataLoader(RankZeroOnly(n), batch_size=4, drop_last=drop_last)
        return _epochs(AccelerateDispatcher(loader.dataset, split_batches=split, _drop_last=drop_last,
                                            batch_sampler=loader.batch_sampler))  # fmt: skip
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _dispatched(rank: int, world: int, n: int, drop_last: bool, split: bool) -> dict[str, Any]:
    config = DataLoaderConfiguration(dispatch_batches=True, split_batches=split)
    accelerator = Accelerator(dataloader_config=config)
    loader = accelerator.prepare(DataLoader(RankZeroOnly(n), batch_size=4, drop_last=drop_last))
    out = {"type": type(loader).__name__, "epochs": _epochs(loader)}
    out["skipped"] = [b.tolist() for b in accelerator.skip_first_batches(loader, 1)]
    out["pickled"] = _epochs(pickle.loads(pickle.dumps(accelerator))._dataloaders[0])
    return out


@pytest.mark.parametrize("n, drop_last, split", [(10, False, False), (9, False, False), (10, True, False),
                                                 (10, False, True)])  # fmt: skip
def test_dispatch_batches_deals_as_accelerate(pool2: WorkerPool, n: int, drop_last: bool, split: bool) -> None:
    ours = pool2.run(_dispatched, n, drop_last, split)
    theirs = pool2.run(_accelerate_reference, n, drop_last, split)
    for rank in range(2):
        assert ours[rank]["type"] == DataLoaderDispatcher.__name__
        assert ours[rank]["epochs"] == theirs[rank], rank
        assert ours[rank]["pickled"] == theirs[rank], rank
        assert ours[rank]["skipped"] == [b for b, _ in theirs[rank][1][0][1:]], rank


def _invariant_refused(rank: int, world: int) -> str:
    plugin = FullyShardedDataParallelPlugin(invariant_micro_batches=2)
    accelerator = Accelerator(fsdp_plugin=plugin, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    try:
        accelerator.prepare(DataLoader(list(range(8)), batch_size=2))
    except ValueError as error:
        return str(error)
    return "not refused"


def test_dispatch_batches_refused_in_invariant_mode(pool2: WorkerPool) -> None:
    for message in pool2.run(_invariant_refused):
        assert message.startswith("DataLoaderConfiguration(dispatch_batches=True) with invariant_micro_batches")

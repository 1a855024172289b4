"""``accelerate.data_loader``: Accelerate's data-loading building blocks and its free ``prepare_data_loader``."""

from fullshard import skip_first_batches
from fullshard.frontend.data.loader_parts import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    DataLoaderStateMixin,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    SkipDataLoader,
)
from fullshard.frontend.data.loader_prepare import prepare_data_loader

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "prepare_data_loader",
    "skip_first_batches",
]

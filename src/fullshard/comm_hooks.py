"""``fullshard.comm_hooks``: communication hooks for ``FullyShardedDataParallel.register_comm_hook``."""

from fullshard.algorithms.comm_hooks import (
    DefaultState,
    LowPrecisionState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    reduce_scatter_hook,
)

__all__ = [
    "DefaultState",
    "LowPrecisionState",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "reduce_scatter_hook",
]

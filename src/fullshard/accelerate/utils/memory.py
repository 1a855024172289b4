"""``accelerate.utils.memory``: freeing memory, and the retry-with-a-smaller-batch helpers."""

from fullshard.frontend.memory import clear_device_cache, should_reduce_batch_size
from fullshard.utils import find_executable_batch_size, release_memory

__all__ = ["clear_device_cache", "find_executable_batch_size", "release_memory", "should_reduce_batch_size"]

"""``accelerate.parallelism_config``."""

from fullshard.frontend.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]

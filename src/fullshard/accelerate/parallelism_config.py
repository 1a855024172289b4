"""``accelerate.parallelism_config``: imported by transformers at module level; fullshard shards data-parallel only."""

from fullshard.frontend.refused import refused_class

ParallelismConfig = refused_class(
    "ParallelismConfig", "fullshard shards data-parallel only (no tensor, context or sequence parallelism)"
)

__all__ = ["ParallelismConfig"]

"""``accelerate.logging``."""

from fullshard.logging import MultiProcessAdapter, get_logger

__all__ = ["MultiProcessAdapter", "get_logger"]

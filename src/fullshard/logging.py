"""``fullshard.logging``: Accelerate's multi-process logger (re-exports only)."""

from fullshard.frontend.processes.process_output import MultiProcessAdapter, get_logger

__all__ = ["MultiProcessAdapter", "get_logger"]

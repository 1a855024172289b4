"""``fullshard.tracking``: Accelerate's ``accelerate.tracking`` names (re-exports only)."""

from fullshard.frontend.tracking import (
    GeneralTracker,
    JSONLinesTracker,
    LoggerType,
    TensorBoardTracker,
    on_main_process,
)
from fullshard.frontend.tracking.selection import available_trackers as get_available_trackers

__all__ = [
    "GeneralTracker",
    "JSONLinesTracker",
    "LoggerType",
    "TensorBoardTracker",
    "get_available_trackers",
    "on_main_process",
]

"""``fullshard.tracking``: Accelerate's ``accelerate.tracking`` names (re-exports only)."""

from fullshard.frontend.tracker_selection import LOGGER_TYPE_TO_CLASS, register_tracker_class
from fullshard.frontend.tracker_selection import available_trackers as get_available_trackers
from fullshard.frontend.trackers import (
    GeneralTracker,
    JSONLinesTracker,
    LoggerType,
    TensorBoardTracker,
    on_main_process,
)

__all__ = [
    "LOGGER_TYPE_TO_CLASS",
    "GeneralTracker",
    "JSONLinesTracker",
    "LoggerType",
    "TensorBoardTracker",
    "get_available_trackers",
    "on_main_process",
    "register_tracker_class",
]

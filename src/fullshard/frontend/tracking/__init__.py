"""Experiment tracking for the ``Accelerator``: ``trackers.py`` (the trackers), ``selection.py`` (``log_with``)."""

from fullshard.frontend.tracking.selection import TrackerSet, available_trackers, resolve_log_with
from fullshard.frontend.tracking.trackers import (
    GeneralTracker,
    JSONLinesTracker,
    LoggerType,
    TensorBoardTracker,
    on_main_process,
)

__all__ = [
    "GeneralTracker",
    "JSONLinesTracker",
    "LoggerType",
    "TensorBoardTracker",
    "TrackerSet",
    "available_trackers",
    "on_main_process",
    "resolve_log_with",
]

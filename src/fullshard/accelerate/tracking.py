"""``accelerate.tracking``: fullshard's trackers (JSON lines, TensorBoard, any registered ``GeneralTracker``).

Accelerate's trackers for other services exist by name and refuse to be built, saying how to log to that service
instead: a ``GeneralTracker`` subclass of your own, passed as ``log_with=`` or registered by name.
"""

from fullshard.frontend.refused import refused_class
from fullshard.tracking import *  # noqa: F403
from fullshard.tracking import __all__ as _fullshard_tracking

_WHY = (
    "fullshard's trackers are jsonl and tensorboard; for this service write a GeneralTracker subclass and pass an "
    "instance as log_with= (or register_tracker_class it)"
)
AimTracker = refused_class("AimTracker", _WHY)
ClearMLTracker = refused_class("ClearMLTracker", _WHY)
CometMLTracker = refused_class("CometMLTracker", _WHY)
DVCLiveTracker = refused_class("DVCLiveTracker", _WHY)
MLflowTracker = refused_class("MLflowTracker", _WHY)
SwanLabTracker = refused_class("SwanLabTracker", _WHY)
TrackioTracker = refused_class("TrackioTracker", _WHY)
WandBTracker = refused_class("WandBTracker", _WHY)

__all__ = [
    *_fullshard_tracking,
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "MLflowTracker",
    "SwanLabTracker",
    "TrackioTracker",
    "WandBTracker",
]

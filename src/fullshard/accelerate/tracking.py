"""``accelerate.tracking``."""

from fullshard.tracking import *  # noqa: F403
from fullshard.tracking import __all__  # noqa: F401

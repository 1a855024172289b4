"""``accelerate.accelerator``."""

from fullshard import Accelerator

__all__ = ["Accelerator"]

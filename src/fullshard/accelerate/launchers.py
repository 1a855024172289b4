"""``accelerate.launchers``: ``debug_launcher`` (CPU processes for tests); ``notebook_launcher`` is refused."""

from fullshard.accelerate import notebook_launcher
from fullshard.frontend.launch_helpers import debug_launcher

__all__ = ["debug_launcher", "notebook_launcher"]

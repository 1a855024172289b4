"""``write_basic_config``: ``fullshard config default`` as a function (Accelerate's name and arguments)."""

from __future__ import annotations

import os
from pathlib import Path

from fullshard.cli.commands.config import default_config
from fullshard.cli.config_file import default_config_path, save_config
from fullshard.frontend import env

__all__ = ["write_basic_config"]


def write_basic_config(
    mixed_precision: str = "no", save_location: str | os.PathLike[str] | None = None, use_xpu: bool = False
) -> Path | bool:
    """Write the basic config (FSDP version 1 on every accelerator, or one CPU process) to ``save_location``
    (default: ``fullshard``'s default config file) and return its path.

    An existing file is left alone and ``False`` returned, as Accelerate does. ``use_xpu`` is accepted for
    compatibility; the machine's devices decide.
    """
    del use_xpu
    precision = str(mixed_precision).lower()
    if precision not in env.MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"write_basic_config(mixed_precision={mixed_precision!r}): expected one of "
            f"{', '.join(map(repr, env.MIXED_PRECISION_CHOICES))}."
        )
    path = Path(save_location) if save_location is not None else default_config_path()
    if path.exists():
        print(f"Configuration already exists at {path}, will not override. Pass a different save_location.")
        return False
    return save_config(default_config(precision), path)

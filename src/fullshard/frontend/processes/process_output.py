"""Output that only some processes show: Accelerate's ``tqdm`` and ``get_logger``.

The process is identified from the launcher's environment (``RANK``, ``LOCAL_RANK``), or from the default
process group when one exists, so both work before and without an ``Accelerator``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

__all__ = ["MultiProcessAdapter", "get_logger", "tqdm"]


def _ranks() -> tuple[int, int]:
    """(global rank, local rank) of this process."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
    return rank, int(os.environ.get("LOCAL_RANK", rank))


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm``, shown on the local main process only unless ``main_process_only=False``."""
    from tqdm.auto import tqdm as _tqdm

    if args and isinstance(args[0], bool):
        raise ValueError(
            f"tqdm({args[0]!r}, ...): the first argument is the iterable; pass main_process_only= as a keyword."
        )
    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = _ranks()[1] != 0
    return _tqdm(*args, **kwargs, disable=disable)


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger whose calls take ``main_process_only`` (default ``True``: log on global rank 0 only) and
    ``in_order`` (every process logs, one after another; a collective)."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        main_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        rank = _ranks()[0]
        if main_only and not in_order:
            if rank == 0:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        for turn in range(world if in_order else 1):
            if not in_order or turn == rank:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            if in_order and world > 1:
                dist.barrier()


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """``logging.getLogger(name)`` wrapped in :class:`MultiProcessAdapter`; ``log_level`` (or the
    ``ACCELERATE_LOG_LEVEL`` variable) sets its level."""
    log_level = log_level or os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logger.root.setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})

"""Helpers for scripts that start their own processes: :func:`patch_environment` and :class:`PrepareForLaunch`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from fullshard.frontend import env
from fullshard.frontend.enums import DistributedType

__all__ = ["PrepareForLaunch", "patch_environment"]


def patch_environment(**kwargs: Any) -> contextlib.AbstractContextManager[None]:
    """Set ``os.environ[KEY.upper()] = str(value)`` for the block; afterwards every key is as it was before."""
    return env.patched({key.upper(): str(value) for key, value in kwargs.items()})


class PrepareForLaunch:
    """Wraps ``launcher`` for ``torch.multiprocessing.start_processes``: process ``index`` gets its rank variables.

    For a multi-process ``distributed_type`` the call sets ``LOCAL_RANK=index`` and ``RANK = NPROC * NODE_RANK +
    index`` (``NPROC`` and ``NODE_RANK`` from the environment, default 1 and 0); the caller sets ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` (e.g. with :func:`patch_environment`). ``debug`` is accepted and unused.
    """

    def __init__(self, launcher: Callable[..., Any], distributed_type: str = "NO", debug: bool = False) -> None:
        self.launcher = launcher
        self.distributed_type = DistributedType(str(getattr(distributed_type, "value", distributed_type)))
        self.debug = debug

    def __call__(self, index: int, *args: Any) -> Any:
        if self.distributed_type is not DistributedType.NO:
            nproc, node_rank = int(os.environ.get("NPROC", 1)), int(os.environ.get("NODE_RANK", 0))
            os.environ["LOCAL_RANK"] = str(index)
            os.environ["RANK"] = str(nproc * node_rank + index)
        os.environ["FORK_LAUNCHED"] = "1"
        return self.launcher(*args)

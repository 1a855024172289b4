"""``AutocastKwargs``: how ``torch.autocast`` runs under the Accelerator's mixed precision (``enabled``,
``cache_enabled``), for ``accelerator.autocast()`` and for the prepared model's forward when it autocasts."""

from __future__ import annotations

from dataclasses import dataclass

from fullshard.frontend.handlers.base import KwargsHandler

__all__ = ["AutocastKwargs"]


@dataclass
class AutocastKwargs(KwargsHandler):
    """``enabled=False`` turns autocast off inside ``accelerator.autocast(autocast_handler=...)`` (or everywhere,
    given to the Accelerator); ``cache_enabled`` is ``torch.autocast``'s weight-cast cache (``None``: torch's)."""

    enabled: bool = True
    cache_enabled: bool | None = None

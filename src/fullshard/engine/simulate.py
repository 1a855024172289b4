"""Planning runs without the ranks: the engine under torch's fake process group (backend ``"fake"``).

Under that backend collectives return at once and move nothing, so a model built on the ``meta`` device can
be wrapped, sharded and stepped with every unit left on ``meta``: the shards, the gathered buffers and the
gradients are meta tensors (shapes and dtypes, no storage) while the engine issues its real collective
schedule and records its bytes in ``COMM_STATS``. Only two engine decisions change (``resolve_device`` picks
``meta`` for an all-meta module, and the first forward does not refuse meta parameters); everything else
runs as it would on real ranks. ``benchmarks/simulate_scale.py`` drives it.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["simulating"]


def simulating() -> bool:
    """True when the default process group is torch's fake backend (nothing is sent, nothing is received)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"

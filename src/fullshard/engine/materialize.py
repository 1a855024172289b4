"""Units built on the ``meta`` device: where their shards live, and taking them back after ``_apply``.

``fully_shard`` on a module built under ``torch.device("meta")`` (without ``param_init_fn`` or
``sync_module_states``) leaves it there, as torch's ``fully_shard`` does: the unit's ``flat_shard`` is a meta
tensor and its sharded parameters are ``DTensor``s of meta local shards, so sharding allocates nothing.
The user then gives the model storage with ``model.to_empty(device=...)`` and initialises it in place
(``reset_parameters()`` per module, or a torchtitan-style ``init_weights``), on the sharded parameters.

``to_empty`` goes through ``nn.Module._apply``, which hands each sharded parameter new local storage (in
place: ``torch.utils.swap_tensors`` for ``DTensor``s, ``.data`` for plain parameters). The unit's
``_apply`` override then calls :meth:`ParamGroup.adopt_applied_params` (``group_moves.py``), which allocates a real
``flat_shard`` and makes the parameters views of it again (see [Note: group buffers] in ``group.py``), so the values the
user writes into them are what the next all-gather reads. Torch's FSDP2 re-reads its sharded parameters the same way
after ``_apply``.

This module imports only torch and ``api.py``; ``group.py`` imports it.
"""

from __future__ import annotations

import torch
from torch import nn

from fullshard.engine.api import Offload

__all__ = ["storage_device_for"]


def storage_device_for(
    label: str, named: list[tuple[str, nn.Parameter]], device: torch.device, offload: Offload | None
) -> torch.device:
    """Where a unit's shards live: ``meta`` when its parameters are (nothing is allocated until ``to_empty``),
    the CPU when offloading, else the compute device ``device``."""
    on_meta = {p.is_meta for _, p in named}
    if on_meta == {True}:
        return torch.device("meta")
    if len(on_meta) > 1:
        names = [name for name, p in named if p.is_meta][:5]
        raise ValueError(
            f"unit {label!r} has parameters on the meta device ({names}) and others with storage; a unit's "
            "parameters must all be on meta (materialized later with to_empty) or all real. Build the whole "
            "module under torch.device('meta'), or initialise it fully before sharding."
        )
    return torch.device("cpu") if offload is not None else device

"""A checkpoint resumed on another run layout: how many processes saved it, and the one warning that a run resumed on
another number of processes goes on differently (none in world-size-invariant mode, where it does not).

``load_state`` (``state_io.py``) calls these; they hold no state of their own. A step saved part-way through in
world-size-invariant mode, which resumes only on the layout that saved it, is ``invariant.py``'s.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch.distributed as dist
from torch import nn

from fullshard.checkpoint import RNG_STATE_NAME, read_manifest
from fullshard.frontend.invariant import invariant_mode

__all__ = ["saved_world_size", "warn_world_size_change"]


def saved_world_size(folder: str | Path) -> int:
    """How many processes saved the checkpoint ``folder``: its manifest's ``world_size``, else (a folder from
    Accelerate) the number of ``random_states_<rank>.pkl`` files; 0 when neither tells."""
    manifest = read_manifest(folder)
    if manifest is not None and manifest.world_size > 0:
        return manifest.world_size
    return sum(1 for _ in Path(folder).glob(f"{RNG_STATE_NAME}_*.pkl"))


def warn_world_size_change(where: str, saved: int, without_rng: list[int], models: list[nn.Module]) -> None:
    """Rank 0 says once, in one line, that a checkpoint from another number of processes goes on differently;
    nothing in world-size-invariant mode, where it goes on bitwise (see [Note: world-size invariance])."""
    world = dist.get_world_size()
    if dist.get_rank() != 0 or saved in (0, world) or (models and all(invariant_mode(m) for m in models)):
        return
    rng = f"ranks {without_rng} had no random states saved and keep theirs; " if without_rng else ""
    warnings.warn(
        f"{where}: the checkpoint was saved by {saved} processes and is loaded by {world}: weights, optimizer, "
        f"schedulers, data position and random states carried over ({rng}the data goes on from the samples "
        f"consumed), but results will differ from a {saved}-process run from here on (gradients are summed in "
        "another order). World-size-invariant mode (invariant_micro_batches) resumes bitwise.",
        stacklevel=3,
    )

"""What a checkpoint carries from one run layout to another: how many processes saved it, and a world-size-invariant
step saved part-way (each rank's partial gradient sums and the accumulation count).

``save_state`` / ``load_state`` (``state_io.py``) call these; they hold no state of their own. A checkpoint saved
at a step boundary loads on any number of processes (one warning that results will differ, none in world-size-
invariant mode, where they do not); one saved part-way through an invariant step loads only on the layout that saved
it (see [Note: world-size invariance] in ``engine/invariant.py``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from fullshard.checkpoint import RNG_STATE_NAME, load_small_file, read_manifest, step_in_progress_file_name
from fullshard.engine import pending_micro_batches, restore_step_in_progress, step_in_progress, unit_states_in

__all__ = [
    "check_step_to_load",
    "check_step_to_save",
    "invariant_mode",
    "per_rank",
    "restore_step",
    "saved_world_size",
    "step_to_save",
    "warn_world_size_change",
]


def invariant_mode(model: nn.Module) -> bool:
    """Whether ``model`` is sharded in world-size-invariant mode (``invariant_micro_batches``)."""
    states = unit_states_in(model)
    return bool(states) and all(s.config.invariant_micro_batches is not None for s in states)


def step_to_save(models: list[nn.Module]) -> dict[str, Any] | None:
    """World-size-invariant mode saved part-way through a step (micro-batches folded, not reduced): this rank's
    partial gradient sums per model (see ``engine/invariant.py``), and how many micro-batches of how many;
    ``None`` at a step boundary or in the default mode."""
    sums = [step_in_progress(unit_states_in(m)) if invariant_mode(m) else None for m in models]
    counts = {e["count"] for saved in sums if saved is not None for e in saved if e["count"]}
    if not counts:
        return None
    return {"micro_batches": max(counts), "per_rank": per_rank(models), "models": sums}


def per_rank(models: list[nn.Module]) -> int:
    """``G/N`` of the first world-size-invariant model: micro-batches per rank and step."""
    for model in models:
        for state in unit_states_in(model):
            if state.group is not None:
                return state.config.invariant_micro_batches // state.group.shard_group.data_parallel_size
    return 0


def check_step_to_save(models: list[nn.Module], gradient_state: Any, where: str) -> None:
    """Refuse a world-size-invariant save made part-way through a step that could not resume as this run goes on:
    ``accumulate()`` counted another number of this step's micro-batches than the units folded (saved after
    ``accumulate()`` was entered and before its ``backward``)."""
    models = [m for m in models if invariant_mode(m)]
    if not models or gradient_state is None:
        return
    folded = max((pending_micro_batches(s.group) for m in models for s in unit_states_in(m)
                  if s.group is not None), default=0)  # fmt: skip
    counted = gradient_state.step % gradient_state.num_steps
    if counted != folded:
        raise ValueError(
            f"{where}: world-size-invariant mode, part-way through a step: accumulate() counted {counted} "
            f"micro-batches of this step but {folded} went through backward, so the resumed run would not finish the "
            "step as this one does. Call save_state after accelerator.backward (inside or after `with "
            "accelerator.accumulate(model):`), or at a step boundary (after optimizer.step())."
        )


def check_step_to_load(folder: Path, models: list[nn.Module], where: str) -> None:
    """Refuse, before anything is loaded, a checkpoint saved part-way through a world-size-invariant step on
    another number of processes (its partial sums are per rank of that layout), or into a model that is not in
    world-size-invariant mode. The same answer on every rank: rank 0's file decides."""
    first = folder / step_in_progress_file_name(0)
    if not first.is_file():
        return
    saved, world = saved_world_size(folder), dist.get_world_size()
    if saved == world and models and all(invariant_mode(m) for m in models):
        return
    step = load_small_file(first)
    done, per_rank = int(step["micro_batches"]), int(step["per_rank"])
    if saved != world:
        raise ValueError(
            f"{where}: the checkpoint was saved {done} micro-batches into a step of {per_rank} per rank, on {saved} "
            f"processes in world-size-invariant mode; those micro-batches' gradients are partial sums of that "
            f"layout, so it resumes only on {saved} processes, not {world}. Resume it on {saved} processes (then "
            "save again at a step boundary), or save the state after optimizer.step() (outside accumulate(), when "
            "accelerator.sync_gradients is True) to resume on any number."
        )
    raise ValueError(
        f"{where}: the checkpoint was saved {done} micro-batches into a world-size-invariant step, but the models "
        "are not all in world-size-invariant mode, which would drop those micro-batches' gradients. Prepare them "
        "with the same FullyShardedDataParallelPlugin(invariant_micro_batches=...) as the run that saved it."
    )


def restore_step(models: list[nn.Module], gradient_state: Any, step: dict[str, Any] | None, where: str) -> None:
    """Put back the partial gradient sums and the accumulation count of a step saved part-way (``step``), or start
    every world-size-invariant model at a step boundary (``None``)."""
    saved = step["models"] if step is not None else [None] * len(models)
    invariant_models = [(m, s) for m, s in zip(models, saved, strict=True) if invariant_mode(m)]
    for model, sums in invariant_models:
        restore_step_in_progress(unit_states_in(model), sums, where)
    if invariant_models and gradient_state is not None:
        gradient_state.step = int(step["micro_batches"]) if step is not None else 0


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

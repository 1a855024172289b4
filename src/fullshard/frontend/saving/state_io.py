"""``save_state`` / ``load_state``: the training checkpoint folder, laid out as Accelerate's.

With ``SHARDED_STATE_DICT`` (the default of ``fsdp_version=2``)::

    dir/
      pytorch_model_fsdp_0/  __0_0.distcp __1_0.distcp .metadata   {"model": sharded model state dict}
      optimizer_0/           __0_0.distcp __1_0.distcp .metadata   {"optimizer": sharded optimizer state}
      scheduler.bin                                                 scheduler 0 (scheduler_1.bin, ...)
      sampler.bin                                                   dataloader 0's epoch, order, position (_1, ...)
      custom_checkpoint_0.pkl                                       objects of register_for_checkpointing
      scaler.pt                                                     the fp16 loss scaler (mixed_precision="fp16")
      random_states_0.pkl random_states_1.pkl                       every rank's RNG states
      step_in_progress_0.pt step_in_progress_1.pt                   world-size-invariant mode saved mid-step only:
                                                                    every rank's partial gradient sums

With ``FULL_STATE_DICT`` the model and optimizer are written by rank 0 in full instead:
``pytorch_model_fsdp.bin`` and ``optimizer.bin`` (``_1``, ... for later ones), as Accelerate names them.

Optimizer ``i`` is saved against model ``i`` (the last model when there are more optimizers). The whole folder
is one atomic unit: every part is staged in ``dir.incomplete`` and committed with a manifest
(``.fullshard_checkpoint.json``: every file's size and CRC-32) by one rename; see [Note: whole-checkpoint
commit] in ``checkpoint/transaction.py``. ``load_state`` checks the parts against the manifest (and, with
``verify``, every checksum) on every rank before modifying anything, and reads every small file without
unpickling arbitrary objects (``checkpoint/safe_load.py``).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.checkpoint import (
    SCALER_NAME,
    Part,
    TrainingFolder,
    background,
    check_before_loading,
    check_sharded,
    checkpoint_folder,
    checkpoint_index,
    custom_checkpoint_file_name,
    folder_for_load,
    full_model_file_name,
    latest_checkpoint,
    load_rng_file,
    load_sharded,
    load_small_file,
    model_folder_name,
    optimizer_file_name,
    optimizer_folder_name,
    prune_checkpoints,
    read_on_every_rank,
    rng_state_file_name,
    sampler_file_name,
    save_folder,
    scheduler_file_name,
    start_save_folder,
    step_in_progress_file_name,
)
from fullshard.engine import (
    StateDictType,
)
from fullshard.frontend import invariant
from fullshard.frontend.plugin import FullyShardedDataParallelPlugin
from fullshard.frontend.project import ProjectConfiguration
from fullshard.frontend.saving import model_state, resume_layout

__all__ = [
    "TrainingObjects",
    "load_state",
    "load_state_as_configured",
    "save_state",
    "save_state_as_configured",
    "start_save_state",
    "wait_for_save",
]


@dataclass
class TrainingObjects:
    """What a checkpoint holds, in ``prepare`` order."""

    models: list[nn.Module] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    dataloaders: list[Any] = field(default_factory=list)
    custom: list[Any] = field(default_factory=list)
    scaler: Any = None  # the ShardedGradScaler of fp16 runs
    gradient_state: Any = None  # the Accelerator's GradientState: its accumulation count, for a mid-step save

    def model_for(self, optimizer_index: int) -> nn.Module:
        return self.models[min(optimizer_index, len(self.models) - 1)]


def _check(objects: TrainingObjects, where: str) -> None:
    if objects.optimizers and not objects.models:
        raise ValueError(
            f"{where}: {len(objects.optimizers)} optimizer(s) were prepared but no model; the sharded optimizer "
            "state is saved by parameter name, which needs the model. Pass the model to accelerator.prepare too."
        )
    for i, obj in enumerate(objects.custom):
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(
                f"{where}: registered object {i} ({type(obj).__name__}) has no state_dict()/load_state_dict(). "
                "register_for_checkpointing takes objects with both methods."
            )


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"random_state": random.getstate(), "torch_manual_seed": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy_random_seed"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random_state"])
    torch.set_rng_state(state["torch_manual_seed"])
    if "numpy_random_seed" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy_random_seed"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys  # Accelerate stores numpy's own array
        np.random.set_state((kind, np.asarray(keys).astype("uint32"), pos, has_gauss, cached))
    if "torch_cuda_manual_seed" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda_manual_seed"])


def _parts_to_save(objects: TrainingObjects, plugin: FullyShardedDataParallelPlugin) -> list[Part]:
    full = plugin.state_dict_type is StateDictType.FULL_STATE_DICT
    parts = []
    for i, model in enumerate(objects.models):
        if full:
            parts.append(Part(full_model_file_name(i), False, partial(model_state.full_model_state_dict, model)))
        else:
            build = partial(lambda m: {"model": model_state.sharded_model_state_dict(m, plugin)}, model)
            parts.append(Part(model_folder_name(i), True, build))
    for i, optimizer in enumerate(objects.optimizers):
        model = objects.model_for(i)
        if full:
            build = partial(model_state.optim_state, model, optimizer, plugin, full=True)
            parts.append(Part(optimizer_file_name(i), False, build))
        else:
            parts.append(Part(optimizer_folder_name(i), True, partial(_sharded_optim_state, model, optimizer, plugin)))
    return parts


def _sharded_optim_state(model: nn.Module, optimizer: Any, plugin: FullyShardedDataParallelPlugin) -> dict[str, Any]:
    # A checkpoint always holds every parameter's state (zeros before the first step): then any fresh
    # optimizer, given the same zero template by load_state, finds every key it expects.
    model_state.init_optimizer_state(optimizer)
    return {"optimizer": model_state.optim_state(model, optimizer, plugin)}


def _small_states(objects: TrainingObjects, rank: int) -> dict[str, Any]:
    """File name -> state of the small files this rank writes: rank 0 the shared ones, every rank its RNG states."""
    states: dict[str, Any] = {}
    if rank == 0:
        states.update({scheduler_file_name(i): s.state_dict() for i, s in enumerate(objects.schedulers)})
        states.update({sampler_file_name(i): d.state_dict() for i, d in enumerate(objects.dataloaders)})
        states.update({custom_checkpoint_file_name(i): o.state_dict() for i, o in enumerate(objects.custom)})
        if objects.scaler is not None:
            states[SCALER_NAME] = objects.scaler.state_dict()
    states[rng_state_file_name(rank)] = _rng_state()
    step = invariant.step_to_save(objects.models)
    if step is not None:
        states[step_in_progress_file_name(rank)] = step
    return states


_SMALL_FILES = "the schedulers, samplers, registered objects and random states"
_HOOKS = "the save_state pre-hooks"


def _folder(
    objects: TrainingObjects, plugin: FullyShardedDataParallelPlugin, before: Callable[[Path], None] | None
) -> TrainingFolder:
    """What goes into the training folder of ``objects``: the model and optimizer parts, each rank's small files,
    and ``before`` (the pre-save hooks) first, which writes into the staging folder."""
    return TrainingFolder(
        _parts_to_save(objects, plugin), partial(_small_states, objects), _SMALL_FILES, before, _HOOKS
    )


def save_state(
    output_dir: str | Path,
    objects: TrainingObjects,
    plugin: FullyShardedDataParallelPlugin,
    before: Callable[[Path], None] | None = None,
) -> Path:
    """Write the checkpoint folder as one atomic unit (a collective: every rank calls it); returns its path.

    Every part is staged in ``<output_dir>.incomplete`` and the folder is renamed into place only when all
    ranks wrote all parts; see [Note: whole-checkpoint commit] in ``checkpoint/transaction.py``. ``before`` (the
    pre-save hooks) is called with the staging folder first: the files it writes there are part of the
    checkpoint (recorded in its manifest). On failure every rank raises and ``output_dir`` holds what it held
    before. A background save still running is waited for first (and its failure raised).
    """
    background.wait()
    where = f"Accelerator.save_state(output_dir='{output_dir}')"
    _check(objects, where)
    invariant.check_step_to_save(objects.models, objects.gradient_state, where)
    return save_folder(output_dir, where, _folder(objects, plugin, before))


def _on_device(plugin: FullyShardedDataParallelPlugin) -> FullyShardedDataParallelPlugin:
    """``plugin`` with its sharded configs' ``offload_to_cpu`` off: the async save copies the shards into its own
    (pinned, kept) host buffers, so offloading first would be a second copy, to pageable memory, on the path
    that blocks training."""
    if plugin.state_dict_type is not StateDictType.SHARDED_STATE_DICT:
        return plugin  # full state dicts are gathered to rank 0's CPU by the engine and deep-copied
    on_device = copy.copy(plugin)
    on_device.state_dict_config = replace(plugin.state_dict_config, offload_to_cpu=False)
    on_device.optim_state_dict_config = replace(plugin.optim_state_dict_config, offload_to_cpu=False)
    return on_device


def start_save_state(
    output_dir: str | Path,
    objects: TrainingObjects,
    plugin: FullyShardedDataParallelPlugin,
    after: Callable[[Path, dist.ProcessGroup | None], None] | None = None,
    before: Callable[[Path], None] | None = None,
) -> Path:
    """:func:`save_state` that returns once this rank's state is copied to host memory (a collective).

    The writes, the commit and then ``after(folder, process_group)`` run in a background thread over their own
    process group; the next ``save_state``, ``load_state`` or ``end_training`` waits for it and raises its
    failure. The files are those of :func:`save_state`; ``before`` runs before this returns. See [Note: background
    saves] in ``checkpoint/background.py``.
    """
    background.wait()
    where = f"Accelerator.save_state(output_dir='{output_dir}', async_save=True)"
    _check(objects, where)
    invariant.check_step_to_save(objects.models, objects.gradient_state, where)
    return start_save_folder(output_dir, where, _folder(objects, _on_device(plugin), before), after)


def wait_for_save() -> None:
    """Wait for the background save of ``save_state(..., async_save=True)``, if one runs; raise its failure."""
    background.wait()


def release_save_buffers() -> None:
    """Wait for the background save, if one runs (raising its failure), then free the host buffers kept
    between async saves (one copy of this rank's sharded model and optimizer state; ``end_training``)."""
    background.release()


def _parts(folder: Path, objects: TrainingObjects, full: bool) -> list[Path]:
    """The model and optimizer parts: files on rank 0 with FULL_STATE_DICT, sharded folders otherwise."""
    files = [folder / (full_model_file_name(i) if full else model_folder_name(i)) for i in range(len(objects.models))]
    return files + [folder / (optimizer_file_name(i) if full else optimizer_folder_name(i))
                    for i in range(len(objects.optimizers))]  # fmt: skip


def _small_files(folder: Path, objects: TrainingObjects) -> list[Path]:
    """The files every rank reads (not the per-rank RNG states)."""
    files = [folder / scheduler_file_name(i) for i in range(len(objects.schedulers))]
    files += [folder / sampler_file_name(i) for i in range(len(objects.dataloaders))]
    files += [folder / custom_checkpoint_file_name(i) for i in range(len(objects.custom))]
    return [*files, *([folder / SCALER_NAME] if objects.scaler is not None else [])]


def _files_to_read(folder: Path, objects: TrainingObjects, full: bool) -> list[Path]:
    return _parts(folder, objects, full) + _small_files(folder, objects)


_MISSING_HINT = (
    "The folder must come from save_state with the same number of models, optimizers, schedulers and registered "
    "objects (and the same state_dict_type)."
)


def _check_before_loading(folder: Path, objects: TrainingObjects, full: bool, verify: bool, where: str) -> list[int]:
    """The checks of ``folder`` on every rank before anything is loaded (one call into checkpoint/); returns the
    ranks that have no random states file (the checkpoint was saved by fewer processes)."""
    rank = dist.get_rank()
    whole = _parts(folder, objects, full) if full and rank == 0 else []  # the full model and optimizer files
    own = [rng_state_file_name(rank), step_in_progress_file_name(rank)]
    present = check_before_loading(
        folder,
        [p.name for p in _files_to_read(folder, objects, full)],
        [p.name for p in [*whole, *_small_files(folder, objects)]],
        own,
        verify=verify,
        where=where,
        hint=_MISSING_HINT,
    )
    return [r for r, (has_rng, _) in enumerate(present) if not has_rng]


def load_state(
    input_dir: str | Path,
    objects: TrainingObjects,
    plugin: FullyShardedDataParallelPlugin,
    *,
    verify: bool = False,
    strict: bool = True,
) -> None:
    """Restore what :func:`save_state` wrote into the prepared objects (a collective).

    Before anything is loaded, every rank checks the folder: every part present with its recorded size and
    from the same save (``checkpoint/load_check.py``), and with ``verify`` every file's checksum (the ranks share
    the reading). Every file is read without unpickling arbitrary objects (``checkpoint/safe_load.py``).
    ``strict=False`` ignores model keys in the checkpoint that the models lack (every key a model has must
    still be there); optimizers always load strictly.
    """
    background.wait()  # a save still being written may be the one to load; its failure is raised here
    where = f"Accelerator.load_state(input_dir='{input_dir}')"
    _check(objects, where)
    folder = folder_for_load(input_dir, where)
    full = plugin.state_dict_type is StateDictType.FULL_STATE_DICT
    without_rng = _check_before_loading(folder, objects, full, verify, where)
    saved_world_size = resume_layout.saved_world_size(folder)
    invariant.check_step_to_load(folder, saved_world_size, objects.models, where)
    resume_layout.warn_world_size_change(where, saved_world_size, without_rng, objects.models)
    small = _read_small_files(folder, objects)  # all read (and agreed on) before anything is modified
    _load_models_and_optimizers(folder, objects, plugin, full, strict)
    for scheduler, state in zip(objects.schedulers, small["schedulers"], strict=True):
        scheduler.load_state_dict(state)
    for loader, state in zip(objects.dataloaders, small["samplers"], strict=True):
        loader.load_state_dict(state)
    for obj, state in zip(objects.custom, small["custom"], strict=True):
        obj.load_state_dict(state)
    if objects.scaler is not None:
        objects.scaler.load_state_dict(small["scaler"])
    invariant.restore_step(objects.models, objects.gradient_state, small["step"], where)
    if small["rng"] is not None:
        _set_rng_state(small["rng"])


def _read_small_files(folder: Path, objects: TrainingObjects) -> dict[str, Any]:
    """Every small file this rank loads, read safely; a refusal on any rank raises on every rank."""

    def read() -> dict[str, Any]:
        rng_file = folder / rng_state_file_name(dist.get_rank())
        step_file = folder / step_in_progress_file_name(dist.get_rank())
        return {
            "schedulers": [load_small_file(folder / scheduler_file_name(i)) for i in range(len(objects.schedulers))],
            "samplers": [load_small_file(folder / sampler_file_name(i)) for i in range(len(objects.dataloaders))],
            "custom": [load_small_file(folder / custom_checkpoint_file_name(i)) for i in range(len(objects.custom))],
            "scaler": load_small_file(folder / SCALER_NAME) if objects.scaler is not None else None,
            "rng": load_rng_file(rng_file) if rng_file.is_file() else None,
            "step": load_small_file(step_file) if step_file.is_file() else None,
        }

    return read_on_every_rank(read)


def _load_models_and_optimizers(
    folder: Path, objects: TrainingObjects, plugin: FullyShardedDataParallelPlugin, full: bool, strict: bool
) -> None:
    if not full:
        _load_sharded_folders(folder, objects, plugin, strict)
        return
    rank = dist.get_rank()
    for i, model in enumerate(objects.models):
        sd = load_small_file(folder / full_model_file_name(i)) if rank == 0 else None
        model_state.load_full_model_state_dict(model, sd, strict=strict)
    for i, optimizer in enumerate(objects.optimizers):
        osd = load_small_file(folder / optimizer_file_name(i)) if rank == 0 else None
        model_state.load_full_optim_state(objects.model_for(i), optimizer, plugin, osd)


def _load_sharded_folders(
    folder: Path, objects: TrainingObjects, plugin: FullyShardedDataParallelPlugin, strict: bool
) -> None:
    """Every model and optimizer folder is checked against its template before any is loaded (collectives).

    A folder that is incomplete or does not fit (keys, shapes) is refused on every rank with the model and
    optimizer untouched; only the optimizer's zero template state (``init_optimizer_state``) exists by then.
    """
    templates = [({"model": model_state.sharded_model_state_dict(model, plugin)}, folder / model_folder_name(i))
                 for i, model in enumerate(objects.models)]  # fmt: skip
    for i, optimizer in enumerate(objects.optimizers):
        model_state.init_optimizer_state(optimizer)
        osd = model_state.optim_state(objects.model_for(i), optimizer, plugin)
        templates.append(({"optimizer": osd}, folder / optimizer_folder_name(i)))
    strictness = [strict] * len(objects.models) + [True] * len(objects.optimizers)
    for (template, path), exact in zip(templates, strictness, strict=True):
        check_sharded(template, path, strict=exact)
    for (template, path), exact in zip(templates, strictness, strict=True):
        load_sharded(template, path, strict=exact)
    for i, model in enumerate(objects.models):
        model_state.finish_model_load(model, plugin, templates[i][0]["model"])
    for i, optimizer in enumerate(objects.optimizers):
        loaded = templates[len(objects.models) + i][0]["optimizer"]
        model_state.load_optim_state(objects.model_for(i), optimizer, plugin, loaded)


def save_state_as_configured(
    output_dir: str | Path | None,
    objects: TrainingObjects,
    plugin: FullyShardedDataParallelPlugin,
    config: ProjectConfiguration,
    before: Callable[[Path], None] | None = None,
    *,
    async_save: bool = False,
) -> Path:
    """``Accelerator.save_state``: pick the folder (automatic naming or ``output_dir``), save, then rotate.

    ``before`` (the pre-save hooks) is called with the staging folder of that folder once the save has claimed
    it: what the hooks write there is committed with the checkpoint, atomically (Accelerate hands its hooks the
    output folder, which it writes in place).

    ``async_save``: return once the state is copied to host memory; the write, the commit and the rotation run
    in the background (:func:`start_save_state`). A previous background save is waited for first.
    """
    background.wait()
    if config.automatic_checkpoint_naming:
        folder = checkpoint_folder(config.project_dir or ".", config.iteration)
        taken = [folder.exists() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(taken, src=0)  # one answer for all ranks: rank 0 may already be writing
        if taken[0]:
            raise ValueError(
                f"Accelerator.save_state(): '{folder}' (iteration {config.iteration}) already exists. Set "
                "accelerator.project_configuration.iteration to the next free number, e.g. after "
                "load_state() (which does it), or remove the folder."
            )
    elif output_dir is None:
        raise ValueError(
            "Accelerator.save_state(): no output_dir, and automatic checkpoint naming is off. Pass a folder, or "
            "Accelerator(project_config=ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True))."
        )
    else:
        folder = Path(output_dir)
    rotate = partial(_rotate, config) if config.automatic_checkpoint_naming else None
    if async_save:
        path = start_save_state(folder, objects, plugin, after=rotate, before=before)
    else:
        path = save_state(folder, objects, plugin, before=before)
        if rotate is not None:
            rotate(path, None)
    config.iteration += 1
    return path


def _rotate(config: ProjectConfiguration, path: Path, group: dist.ProcessGroup | None) -> None:
    """Delete the oldest complete checkpoints beyond ``total_limit`` once ``path`` is complete (a collective)."""
    if dist.get_rank() == 0:
        prune_checkpoints(config.project_dir or ".", config.total_limit, keep=path)
    dist.barrier(group=group)  # nobody lists the checkpoints while rank 0 deletes old ones


def load_state_as_configured(
    input_dir: str | Path | None,
    objects: TrainingObjects,
    plugin: FullyShardedDataParallelPlugin,
    config: ProjectConfiguration,
    *,
    verify: bool = False,
    strict: bool = True,
    say: Any = print,
    before: Callable[[Path], None] | None = None,
) -> Path:
    """``Accelerator.load_state``: ``input_dir``, or the newest complete automatic checkpoint; returns the folder.

    After loading an automatic checkpoint ``checkpoint_<i>``, the next ``save_state()`` writes
    ``checkpoint_<i+1>`` (``config.iteration`` is raised to ``i + 1``; Accelerate leaves it and then refuses
    to overwrite).
    """
    background.wait()  # before looking for the latest checkpoint, which may be the one being written
    if input_dir is not None:
        if before is not None:
            before(Path(input_dir))
        load_state(input_dir, objects, plugin, verify=verify, strict=strict)
        return Path(input_dir)
    if not config.automatic_checkpoint_naming:
        raise ValueError(
            "Accelerator.load_state(): no input_dir, and automatic checkpoint naming is off. Pass the folder "
            "save_state wrote, or use ProjectConfiguration(automatic_checkpoint_naming=True)."
        )
    found: list[Any] = [latest_checkpoint(config.project_dir or ".") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)  # every rank loads the folder rank 0 chose
    latest = found[0]
    if latest is None:
        raise FileNotFoundError(
            f"Accelerator.load_state(): no complete checkpoint under '{Path(config.project_dir or '.')}/checkpoints'. "
            "Ask first with fullshard.utils.latest_checkpoint(project_dir), which returns None in that case."
        )
    say(f"Accelerator.load_state(): loading {latest}, the latest complete checkpoint")
    if before is not None:
        before(latest)
    load_state(latest, objects, plugin, verify=verify, strict=strict)
    config.iteration = max(config.iteration, (checkpoint_index(latest) or 0) + 1)
    return latest

"""The Accelerator's checkpoint and weights methods: ``register_for_checkpointing``, ``save_state`` /
``load_state`` with their pre-hooks, ``get_state_dict``, ``save_model`` and ``save``.

The Accelerator mixes in :class:`AcceleratorCheckpoints`; what goes into a training folder is ``state_io.py``'s,
a model's state dicts are ``model_state.py``'s, and how files are written and checked is ``fullshard.checkpoint``'s.
Invariants: every object ``save_state`` writes is one the Accelerator prepared or registered (``_objects``), so a
``load_state`` of the same folder restores the same list; the pre-hooks run before anything is written or read,
in registration order; DeepSpeed's extra keywords are refused by name, never dropped. The class reads, and does not
set up, the Accelerator's ``_objects``, ``fsdp_plugin``, ``project_configuration``, ``_save_state_pre_hooks`` /
``_load_state_pre_hooks`` and process fields.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fullshard.checkpoint import save_weights
from fullshard.frontend import ops
from fullshard.frontend.saving import model_state, state_io

__all__ = ["AcceleratorCheckpoints"]


class AcceleratorCheckpoints:
    """The Accelerator's checkpoint and weights methods; see the module docstring."""

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` (with ``state_dict``/``load_state_dict``) in ``save_state``/``load_state``."""
        bad = [
            f"Item at index {i} ({type(o).__name__})"
            for i, o in enumerate(objects)
            if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))
        ]
        if bad:
            raise ValueError(
                f"Accelerator.register_for_checkpointing(...): {', '.join(bad)} lack state_dict() and "
                "load_state_dict(). Register objects that have both (or wrap yours in a class that does)."
            )
        self._objects.custom.extend(objects)

    project_dir = property(lambda self: self.project_configuration.project_dir, doc="ProjectConfiguration's folder.")
    save_iteration = property(lambda self: self.project_configuration.iteration, doc="The next checkpoint_<i>.")

    def save_state(
        self,
        output_dir: str | Path | None = None,
        safe_serialization: bool = True,
        *,
        async_save: bool | None = None,
        **kwargs: Any,
    ) -> str:
        """Write a checkpoint folder (see ``saving/state_io.py``) as one atomic unit; returns its path.

        With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` the folder is
        ``<project_dir>/checkpoints/checkpoint_<save_iteration>`` (``output_dir`` is ignored, as in Accelerate)
        and, once it is complete, the oldest complete checkpoints beyond ``total_limit`` are deleted. The hooks of
        :meth:`register_save_state_pre_hook` run first. ``safe_serialization`` is accepted as in Accelerate,
        where under FSDP it changes nothing either: sharded models and optimizers are DCP folders, full ones
        ``.bin`` files. Accelerate's other keywords go to DeepSpeed's ``save_checkpoint`` and are refused here.

        ``async_save=True`` (torch's ``dcp.async_save``): return once this rank's state is copied to host memory;
        the files are written, checksummed and committed in a background thread, and the old checkpoints rotated
        after. The next ``save_state``, ``load_state`` and ``end_training`` (and process exit) wait for it, and
        raise its failure; the folder appears only once complete. The host copy's buffers are kept for the next
        async save (copied into again when the shapes and dtypes match: much faster than new memory), so one
        copy of this rank's sharded model and optimizer state (fp32 AdamW: 12 bytes per parameter / ranks)
        stays in host memory, pinned for CUDA state, until ``end_training`` or process exit. See
        ``docs/checkpoints.md``. ``async_save=None`` (not given): ``ProjectConfiguration(async_save=...)``, whose
        default is ``FULLSHARD_ASYNC_SAVE`` (else off).
        """
        _refuse_extra_kwargs("save_state", kwargs, "they are DeepSpeed's save_checkpoint arguments")
        del safe_serialization

        def run_hooks(folder: Path) -> None:  # no weights list: FSDP models save themselves
            for hook in self._save_state_pre_hooks.values():
                hook(self._objects.models, [], str(folder))

        return str(state_io.save_state_as_configured(output_dir, self._objects, self.fsdp_plugin,
                                                     self.project_configuration, before=run_hooks,
                                                     async_save=async_save if async_save is not None
                                                     else bool(self.project_configuration.async_save)))  # fmt: skip

    def load_state(
        self,
        input_dir: str | Path | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        verify: bool = False,
        strict: bool = True,
        map_location: Any = None,
        **kwargs: Any,
    ) -> None:
        """Restore models, optimizers, schedulers, registered objects and RNG states from ``save_state``'s folder.

        With no ``input_dir`` and automatic checkpoint naming, the newest complete checkpoint is loaded (and
        named on the main process); ``verify=True`` checks every file's checksum first (``fullshard verify``);
        ``strict=False`` ignores model keys the checkpoint has and the models lack. The hooks of
        :meth:`register_load_state_pre_hook` run first. ``map_location`` may be None, ``"cpu"`` or
        ``"on_device"`` (everything is read on the CPU and placed where the prepared objects live);
        ``load_kwargs`` and other keywords are DeepSpeed's in Accelerate and are refused.
        """
        _refuse_extra_kwargs("load_state", {**kwargs, **(load_kwargs or {})}, "they are DeepSpeed's arguments")
        if map_location not in (None, "cpu", "on_device"):
            raise ValueError(
                f"Accelerator.load_state(map_location={map_location!r}): expected None, 'cpu' or 'on_device'; "
                "files are read on the CPU and each object keeps its device."
            )

        def run_hooks(folder: Path) -> None:
            for hook in self._load_state_pre_hooks.values():
                hook(self._objects.models, str(folder))

        state_io.load_state_as_configured(input_dir, self._objects, self.fsdp_plugin, self.project_configuration,
                                          verify=verify, strict=strict, say=self.print, before=run_hooks)  # fmt: skip

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict on rank 0, on the CPU, by original names (``{}`` on the other ranks); a collective."""
        del unwrap  # names are always the original module's
        if not model_state.has_units(model):  # never prepared: its own state dict, as Accelerate returns it
            return model.state_dict()
        return model_state.full_model_state_dict(model)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | Path,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the full weights (``model.safetensors`` or ``pytorch_model.bin``, sharded above ``max_shard_size``)."""
        state_dict = self.get_state_dict(model)
        if self.is_main_process:
            save_weights(
                state_dict, save_directory, safe_serialization=safe_serialization, max_shard_size=max_shard_size
            )
        self.wait_for_everyone()

    def save(self, obj: Any, f: str | Path, safe_serialization: bool = False) -> None:
        ops.save(obj, f, safe_serialization=safe_serialization)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` at the start of every ``save_state`` (``weights`` is ``[]``:
        sharded models write their own files, as under FSDP in Accelerate); ``handle.remove()`` unregisters it.

        ``output_dir`` is the save's staging folder (``<folder>.incomplete``, existing and empty but for the save's
        tag): the files the hook writes there are committed with the checkpoint, renamed into ``<folder>`` with
        it, and recorded in its manifest."""
        handle = RemovableHandle(self._save_state_pre_hooks)
        self._save_state_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` at the start of every ``load_state``."""
        handle = RemovableHandle(self._load_state_pre_hooks)
        self._load_state_pre_hooks[handle.id] = hook
        return handle


def _refuse_extra_kwargs(method: str, kwargs: dict[str, Any], why: str) -> None:
    if kwargs:
        names = ", ".join(f"{k}=" for k in sorted(kwargs))
        raise TypeError(f"Accelerator.{method}({names}...): not supported; {why}. Remove them.")

"""``Accelerator``: Accelerate's training front end over the fullshard engine.

A script written for Accelerate keeps working after ``from accelerate import Accelerator`` becomes
``from fullshard import Accelerator``. The model is always sharded: with no ``fsdp_plugin`` the default
:class:`FullyShardedDataParallelPlugin` is used, which reads the ``FSDP_*`` variables ``fullshard launch`` sets.
A script run without a launcher is one process with a process group of one rank (see [Note: single process]
in ``runtime.py``). This class only dispatches; the work is done in ``prepare.py`` (models), ``data.py``,
``optim.py``, ``training.py`` (per-step helpers), ``state_io.py`` and ``model_state.py`` (checkpoints).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from fullshard.checkpoint import save_weights
from fullshard.engine.grad_scaler import ShardedGradScaler
from fullshard.frontend import env, model_state, ops, runtime, state_io, training
from fullshard.frontend.data import GradientState, prepare_data_loader
from fullshard.frontend.optim import AcceleratedOptimizer, AcceleratedScheduler
from fullshard.frontend.plugin import FullyShardedDataParallelPlugin
from fullshard.frontend.prepare import prepare_model, switch_optimizer_to_sharded
from fullshard.frontend.project import ProjectConfiguration, resolve_project_configuration
from fullshard.frontend.types import DistributedType, PrecisionType

__all__ = ["Accelerator"]

# Accelerate arguments accepted for compatibility that change nothing here (a warning says so).
_IGNORED_KWARGS = ("log_with", "kwargs_handlers", "dataloader_config", "rng_types", "dynamo_backend", "dynamo_plugin",
                   "device_placement")  # fmt: skip


def _check_args(gradient_accumulation_steps: object, fsdp_plugin: object, split_batches: object) -> None:
    steps = gradient_accumulation_steps
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(
            f"Accelerator(gradient_accumulation_steps={steps!r}): expected an int >= 1 (1 means no accumulation)."
        )
    if fsdp_plugin is not None and not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
        raise TypeError(
            f"Accelerator(fsdp_plugin={type(fsdp_plugin).__name__}): expected a FullyShardedDataParallelPlugin "
            "(from fullshard import FullyShardedDataParallelPlugin), or None for the default plugin."
        )
    if split_batches:
        raise ValueError(
            "Accelerator(split_batches=True): fullshard deals whole batches to ranks (each rank's batch has the "
            "DataLoader's batch_size). Pass split_batches=False and divide the batch size by num_processes."
        )


def _resolve_precision(mixed_precision: object) -> PrecisionType:
    if mixed_precision is None:
        mixed_precision = env.read_launch_env().get("mixed_precision")
    return PrecisionType.parse(mixed_precision, arg="Accelerator(mixed_precision)")


class Accelerator:
    """Prepares models, optimizers, dataloaders and schedulers for sharded training; see the module docstring."""

    def __init__(
        self,
        split_batches: bool = False,
        mixed_precision: str | PrecisionType | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        even_batches: bool = True,
        step_scheduler_with_optimizer: bool = True,
        project_dir: str | Path | None = None,
        project_config: ProjectConfiguration | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - set(_IGNORED_KWARGS))
        if unknown:
            raise TypeError(
                f"Accelerator({unknown[0]}=...): not an argument fullshard knows. Supported: split_batches, "
                "mixed_precision, gradient_accumulation_steps, cpu, fsdp_plugin, even_batches, "
                "step_scheduler_with_optimizer, project_dir, project_config "
                f"(accepted and ignored: {', '.join(_IGNORED_KWARGS)})."
            )
        if kwargs:
            warnings.warn(f"Accelerator: {sorted(kwargs)} are accepted for compatibility and ignored.", stacklevel=2)
        _check_args(gradient_accumulation_steps, fsdp_plugin, split_batches)
        self.project_configuration = resolve_project_configuration(project_dir, project_config)
        self.mixed_precision = _resolve_precision(mixed_precision).value
        cpu = cpu or bool(env.read_launch_env().get("use_cpu", False))
        self.fsdp_plugin = fsdp_plugin if fsdp_plugin is not None else FullyShardedDataParallelPlugin()
        if self.mixed_precision != "no" and self.fsdp_plugin.mixed_precision_policy is None:
            self.fsdp_plugin.set_mixed_precision(self.mixed_precision)
        self.even_batches = even_batches
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.gradient_state = GradientState(num_steps=gradient_accumulation_steps)
        self._process = runtime.init_process_state(cpu=cpu)
        self._objects = state_io.TrainingObjects()
        if self.mixed_precision == PrecisionType.FP16.value:  # loss scaling, the skip agreed by all ranks
            self._objects.scaler = ShardedGradScaler(device=self.device.type)

    # --- process ------------------------------------------------------------------------------------

    @property
    def state(self) -> Accelerator:
        """Accelerate's ``accelerator.state``: here the accelerator itself (``.fsdp_plugin``, ``.device``, ...)."""
        return self

    device = property(lambda self: self._process.device, doc="The device this process computes on.")
    process_index = property(lambda self: self._process.process_index, doc="Global rank.")
    local_process_index = property(lambda self: self._process.local_process_index, doc="Rank on this machine.")
    num_processes = property(lambda self: self._process.num_processes, doc="World size.")
    is_main_process = property(lambda self: self._process.is_main_process, doc="Global rank 0.")
    is_local_main_process = property(lambda self: self._process.is_local_main_process, doc="Local rank 0.")

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType.FSDP

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def sync_gradients(self) -> bool:
        """Whether this step reduces gradients and steps the optimizer (``False`` on accumulation steps)."""
        return self.gradient_state.sync_gradients

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @property
    def scaler(self) -> ShardedGradScaler | None:
        """The fp16 loss scaler (``None`` unless ``mixed_precision="fp16"``)."""
        return self._objects.scaler

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in self._objects.optimizers)

    def wait_for_everyone(self) -> None:
        self._process.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self._process.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self._process.main_process_first(local=True)

    def print(self, *args: Any, **kwargs: Any) -> None:
        self._process.print(*args, **kwargs)

    def end_training(self) -> None:
        """Wait for every process, then release the process group if this Accelerator created it."""
        self.wait_for_everyone()
        runtime.shutdown()

    # --- prepare ------------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare each argument (models first, then optimizers, then schedulers); return them in order."""
        del device_placement  # batches always go to self.device
        result = list(args)
        for passes in (self._prepare_first, self._prepare_optimizer, self._prepare_scheduler):
            result = [passes(obj) for obj in result]
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_first(self, obj: Any) -> Any:
        if isinstance(obj, nn.Module):
            return self.prepare_model(obj)
        if isinstance(obj, DataLoader):
            return self.prepare_data_loader(obj)
        return obj

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        """Shard ``model`` as the plugin says (see ``prepare.py``) and remember it for checkpoints."""
        prepared = prepare_model(model, self.fsdp_plugin, self.device)
        precision = PrecisionType(self.mixed_precision)
        autocast = training.needs_autocast(precision, self.fsdp_plugin.mixed_precision_policy)
        training.wrap_forward_for_precision(prepared, precision, self.device, autocast=autocast)
        self._objects.models.append(prepared)
        return prepared

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None) -> DataLoader:
        """This rank's share of ``data_loader``; see [Note: batch dealing] in ``data.py``."""
        prepared = prepare_data_loader(
            data_loader,
            num_processes=self.num_processes,
            process_index=self.process_index,
            device=self.device,
            gradient_state=self.gradient_state,
            even_batches=self.even_batches,
        )
        self._objects.dataloaders.append(prepared)
        return prepared

    def _prepare_optimizer(self, obj: Any) -> Any:
        if not isinstance(obj, torch.optim.Optimizer) or isinstance(obj, AcceleratedOptimizer):
            return obj
        switch_optimizer_to_sharded(obj)
        wrapped = AcceleratedOptimizer(obj, self.gradient_state, self.scaler)
        self._objects.optimizers.append(wrapped)
        return wrapped

    def _prepare_scheduler(self, obj: Any) -> Any:
        if not (hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "get_last_lr")):
            return obj
        if isinstance(obj, AcceleratedScheduler):
            return obj
        optimizers = [o for o in self._objects.optimizers if o.optimizer is obj.optimizer or o is obj.optimizer]
        wrapped = AcceleratedScheduler(
            obj, optimizers, self.gradient_state, self.num_processes, self.step_scheduler_with_optimizer
        )
        self._objects.schedulers.append(wrapped)
        return wrapped

    # --- training step ------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by ``1 / gradient_accumulation_steps`` (and the fp16 loss scale)."""
        loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Divide the gradients by the fp16 loss scale (a no-op otherwise); at most once per optimizer step.

        Skipped on accumulation steps: the gradients are incomplete, and the next backward would add scaled
        values to unscaled ones.
        """
        if self.scaler is None or not self.sync_gradients:
            return
        optimizers = self._objects.optimizers if optimizer is None else [optimizer]
        for opt in optimizers:
            self.scaler.unscale_(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-batch: no gradient reduction unless it completes an accumulation step (or the loader)."""
        training.advance_step(self.gradient_state)
        with contextlib.ExitStack() as stack:
            if not self.sync_gradients:
                for model in models:
                    stack.enter_context(training.no_sync(model))
            yield

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return training.no_sync(model)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip gradients to a global norm over all shards; returns the norm before clipping (equal on all ranks).

        With fp16 the gradients are unscaled first, so ``max_norm`` applies to the true gradients.
        """
        self.unscale_gradients()
        return training.clip_grad_norm(self._objects.models, parameters, max_norm, norm_type)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return training.autocast_context(PrecisionType(self.mixed_precision), self.device)

    # --- data across processes ----------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        return ops.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``gather``, minus the samples ``even_batches`` repeated to fill the last global batch."""
        objects = use_gather_object or not _all_tensors(input_data)
        data = ops.gather_object(input_data) if objects else ops.gather(input_data)
        return training.truncate_for_metrics(data, self.gradient_state, objects=objects)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return ops.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        return ops.pad_across_processes(tensor, dim, pad_index, pad_first)

    # --- checkpoints and weights --------------------------------------------------------------------

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` (with ``state_dict``/``load_state_dict``) in ``save_state``/``load_state``."""
        bad = [type(o).__name__ for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if bad:
            raise TypeError(
                f"Accelerator.register_for_checkpointing({', '.join(bad)}): these objects lack state_dict() and "
                "load_state_dict(). Register objects that have both (or wrap yours in a class that does)."
            )
        self._objects.custom.extend(objects)

    project_dir = property(lambda self: self.project_configuration.project_dir, doc="ProjectConfiguration's folder.")
    logging_dir = property(lambda self: self.project_configuration.logging_dir, doc="Where trackers log.")
    save_iteration = property(lambda self: self.project_configuration.iteration, doc="The next checkpoint_<i>.")

    def save_state(self, output_dir: str | Path | None = None, **_: Any) -> str:
        """Write a checkpoint folder (see ``state_io.py``) as one atomic unit; returns its path.

        With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` the folder is
        ``<project_dir>/checkpoints/checkpoint_<save_iteration>`` (``output_dir`` is ignored, as in Accelerate)
        and, once it is complete, the oldest complete checkpoints beyond ``total_limit`` are deleted.
        """
        return str(state_io.save_state_as_configured(output_dir, self._objects, self.fsdp_plugin,
                                                     self.project_configuration))  # fmt: skip

    def load_state(self, input_dir: str | Path | None = None, verify: bool = False, **_: Any) -> None:
        """Restore models, optimizers, schedulers, registered objects and RNG states from ``save_state``'s folder.

        With no ``input_dir`` and automatic checkpoint naming, the newest complete checkpoint is loaded (and
        named on the main process); ``verify=True`` checks every file's checksum first (``fullshard verify``).
        """
        state_io.load_state_as_configured(input_dir, self._objects, self.fsdp_plugin, self.project_configuration,
                                          verify=verify, say=self.print)  # fmt: skip

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict on rank 0, on the CPU, by original names (``{}`` on the other ranks); a collective."""
        del unwrap  # names are always the original module's
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

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
        return training.extract_model_from_parallel(model, keep_fp32_wrapper)


def _all_tensors(data: Any) -> bool:
    found: list[bool] = []
    ops.recursively_apply(lambda t: found.append(True), data)
    leaves: list[Any] = []
    ops.recursively_apply(lambda x: leaves.append(x), data, test_type=lambda x: True)
    return bool(found) and len(found) == len(leaves)

"""``Accelerator``: Accelerate's training front end over the fullshard engine.

A script written for Accelerate keeps working after ``from accelerate import Accelerator`` becomes
``from fullshard import Accelerator``. The model is sharded whenever FSDP is asked for or several processes run:
with no ``fsdp_plugin`` the default :class:`FullyShardedDataParallelPlugin` is used, which reads the ``FSDP_*``
variables ``fullshard launch`` sets. One process with nothing asking for FSDP runs the model as it is, as
Accelerate's ``DistributedType.NO`` does (see [Note: one process without FSDP] in ``one_process.py``).
A script run without a launcher is one process with a process group of one rank (see [Note: single process]
in ``processes/runtime.py``). This class checks its arguments, holds the run's state and dispatches; the work is
done in ``prepare.py`` (models), ``data/`` (loaders), ``optim.py``, ``training.py`` (per-step helpers),
``invariant.py`` (world-size-invariant mode), ``saving/`` (checkpoints) and ``processes/`` (the process and
Accelerate's shared state); Accelerate's utilities in ``handlers/`` (kwargs handlers), ``trackers.py`` with
``tracker_selection.py`` (trackers) and ``ops.py`` (tensor operations across processes: gather, reduce, pad, ...).
Three groups of its methods live in the classes it mixes in, each a job of its own: ``one_process.py``
(``ShardingChoice``: whether it shards, ``distributed_type``), ``training_step.py`` (``TrainingStep``: ``backward``,
``accumulate``, clipping, ``autocast``, ...) and ``saving/accelerator_checkpoints.py`` (``AcceleratorCheckpoints``:
``save_state``, ``load_state``, ``save_model``, ...). They hold no state of their own: the attributes they read are
set here, in ``__init__``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from fullshard.frontend import env, invariant, memory, ops, preemption, training
from fullshard.frontend.compile import TorchDynamoPlugin, compile_model, resolve_dynamo_plugin
from fullshard.frontend.data.dataloader_config import DataLoaderConfiguration, resolve_dataloader_config
from fullshard.frontend.data.loader_parts import dealt_as_accelerate, dispatch_loader, shard_loader
from fullshard.frontend.data.sharded_loader import RNG_TYPES, GradientState, prepare_data_loader, skip_first_batches
from fullshard.frontend.enums import DynamoBackend, PrecisionType
from fullshard.frontend.handlers import collect_handlers, ddp, grad, process_group_kwargs
from fullshard.frontend.one_process import ShardingChoice, wants_sharding
from fullshard.frontend.optim import AcceleratedOptimizer, AcceleratedScheduler
from fullshard.frontend.parallelism import (
    ParallelismConfig,
    check_model_tp,
    data_parallel_position,
    resolve_parallelism_config,
)
from fullshard.frontend.plugin import FullyShardedDataParallelPlugin
from fullshard.frontend.prepare import is_sharded, prepare_model, prepare_whole_param_step, switch_optimizer_to_sharded
from fullshard.frontend.processes import runtime
from fullshard.frontend.processes import work_split as processes
from fullshard.frontend.processes.shared_state import AcceleratorState, PartialState
from fullshard.frontend.project import ProjectConfiguration, resolve_project_configuration
from fullshard.frontend.saving import state_io
from fullshard.frontend.saving.accelerator_checkpoints import AcceleratorCheckpoints
from fullshard.frontend.tracker_selection import TrackerSet, resolve_log_with
from fullshard.frontend.trackers import GeneralTracker
from fullshard.frontend.training_step import TrainingStep

__all__ = ["Accelerator"]


def _check_dispatch(invariant: bool, data_parallel: int, processes: int) -> None:
    """``dispatch_batches=True`` sends rank 0's batches to every process: refused where ranks must get other
    batches than their index says (world-size-invariant mode, tensor parallel groups sharing a batch)."""
    if invariant:
        raise ValueError(
            "DataLoaderConfiguration(dispatch_batches=True) with invariant_micro_batches: world-size-invariant mode "
            "deals each micro-batch by its index on every rank. Pass dispatch_batches=None (or False)."
        )
    if data_parallel != processes:
        raise ValueError(
            f"DataLoaderConfiguration(dispatch_batches=True) with a ParallelismConfig of {data_parallel} data "
            f"parallel ranks among {processes} processes: dispatching sends every process its own part. Pass "
            "dispatch_batches=None (or False); the ranks of one tensor parallel group then share their batches."
        )


def _check_device_placement(value: object, where: str) -> None:
    """Batches and shards always live on ``accelerator.device``: only the default (placing them) is possible."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if any(v is not None and not v for v in values):
        raise ValueError(
            f"{where}(device_placement={value!r}): fullshard always places the sharded model and the prepared "
            "batches on accelerator.device (the engine gathers and reduces there). Leave device_placement at its "
            "default."
        )


def _check_rng_types(rng_types: object) -> tuple[str, ...]:
    if rng_types is None:
        return ("generator",)
    kinds = [str(getattr(k, "value", k)) for k in rng_types] if isinstance(rng_types, (list, tuple)) else None
    bad = [k for k in kinds or [] if k not in RNG_TYPES]
    if kinds is None or bad:
        raise ValueError(
            f"Accelerator(rng_types={rng_types!r}): expected a list of {', '.join(map(repr, RNG_TYPES))} (the random "
            "states synchronised from rank 0 at each epoch), or None for ['generator']."
        )
    return tuple(kinds)


def _check_args(gradient_accumulation_steps: object, fsdp_plugin: object) -> None:
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


def _default_plugin(config: ParallelismConfig | None) -> FullyShardedDataParallelPlugin:
    """The plugin when none is given: from the environment; under a ParallelismConfig, version 2 unless the
    environment says otherwise (the config's mesh is ``fully_shard``'s)."""
    if config is not None and "fsdp_version" not in env.read_env():
        return FullyShardedDataParallelPlugin(fsdp_version=2)
    return FullyShardedDataParallelPlugin()


def _resolve_precision(mixed_precision: object) -> PrecisionType:
    if mixed_precision is None:
        mixed_precision = env.read_launch_env().get("mixed_precision")
    return PrecisionType.parse(mixed_precision, arg="Accelerator(mixed_precision)")


def _answered_by_state(name: str) -> property:
    """A process field of the accelerator, answered while the shared AcceleratorState stands; see [Note: reset
    state]."""
    field: property = getattr(runtime.ProcessView, name)

    def get(self: Accelerator) -> Any:
        AcceleratorState.require(name)
        return field.fget(self)  # type: ignore[misc]

    return property(get, doc=field.__doc__)


class Accelerator(ShardingChoice, TrainingStep, AcceleratorCheckpoints, runtime.ProcessView):
    """Prepares models, optimizers, dataloaders and schedulers for sharded training; see the module docstring."""

    deepspeed_plugin = None  # accelerator.state.deepspeed_plugin: scripts test it to pick DeepSpeed's placeholders

    def __init__(
        self,
        split_batches: bool | None = None,
        mixed_precision: str | PrecisionType | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        rng_types: list[str] | None = None,
        even_batches: bool | None = None,
        step_scheduler_with_optimizer: bool = True,
        gradient_accumulation_plugin: grad.GradientAccumulationPlugin | None = None,
        kwargs_handlers: list[Any] | None = None,
        log_with: Any = None,
        project_dir: str | Path | None = None,
        project_config: ProjectConfiguration | None = None,
        device_placement: bool = True,
        dynamo_backend: DynamoBackend | str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        parallelism_config: ParallelismConfig | None = None,
        **kwargs: Any,
    ) -> None:
        _refuse_accelerate_only_plugins(kwargs)
        if kwargs:
            raise TypeError(
                f"Accelerator({sorted(kwargs)[0]}=...): not an argument fullshard knows. Supported: split_batches, "
                "mixed_precision, gradient_accumulation_steps, cpu, dataloader_config, fsdp_plugin, rng_types, "
                "even_batches, step_scheduler_with_optimizer, gradient_accumulation_plugin, kwargs_handlers, "
                "log_with, project_dir, project_config, device_placement, dynamo_backend, dynamo_plugin, "
                "parallelism_config."
            )
        _check_device_placement(device_placement, "Accelerator")
        _check_args(gradient_accumulation_steps, fsdp_plugin)
        self.dynamo_plugin = resolve_dynamo_plugin(dynamo_backend, dynamo_plugin)
        self._handlers, other_handlers = collect_handlers(kwargs_handlers)
        init_kwargs = process_group_kwargs(other_handlers)  # InitProcessGroupKwargs; any other handler refused
        accumulation = grad.resolve_accumulation(gradient_accumulation_plugin, gradient_accumulation_steps)
        self.dataloader_config = resolve_dataloader_config(dataloader_config, split_batches, even_batches)
        self.rng_types = _check_rng_types(rng_types)
        self.project_configuration = resolve_project_configuration(project_dir, project_config)
        self.mixed_precision = _resolve_precision(mixed_precision).value
        cpu = cpu or bool(env.read_launch_env().get("use_cpu", False))
        self.parallelism_config = resolve_parallelism_config(parallelism_config)
        self.fsdp_plugin = fsdp_plugin if fsdp_plugin is not None else _default_plugin(self.parallelism_config)
        if self.mixed_precision != "no" and self.fsdp_plugin.mixed_precision_policy is None:
            self.fsdp_plugin.set_mixed_precision(self.mixed_precision)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.gradient_state = GradientState(
            num_steps=accumulation.num_steps,
            sync_with_dataloader=accumulation.sync_with_dataloader,
            sync_each_batch=accumulation.sync_each_batch,
            adjust_scheduler=accumulation.adjust_scheduler,
        )
        self._process = runtime.init_process_state(cpu=cpu, **init_kwargs)
        PartialState._adopt(self._process, cpu)  # PartialState() now answers for this process, as in Accelerate
        self._sharding = wants_sharding(fsdp_plugin is not None, self.parallelism_config, self._process.num_processes)
        self._objects = state_io.TrainingObjects(gradient_state=self.gradient_state)
        self._register_state()  # first: this accelerator's process fields are answered through it
        self.torch_device_mesh = None
        if self.parallelism_config is not None:  # checked against the processes first, then the mesh is built
            self.parallelism_config._validate_accelerator(self)
            self.torch_device_mesh = self.parallelism_config.get_device_mesh(self.device.type)
        # World-size-invariant mode: G/N micro-batches per rank and step (see invariant.py).
        dp_size = data_parallel_position(self.parallelism_config, self.process_index, self.num_processes)[1]
        self._invariant = invariant.configure(self.fsdp_plugin.invariant_micro_batches, dp_size, accumulation.num_steps)
        if self._invariant is not None:
            self.gradient_state.num_steps = self._invariant.per_rank
            self.gradient_state.caller_steps = invariant.CallerSteps(self._invariant)
        self._accumulating = False
        if self.mixed_precision == PrecisionType.FP16.value:  # loss scaling, the skip agreed by all ranks
            self._objects.scaler = grad.build_scaler(self._handlers.scaler, self.device)
        self.logging_dir = self.project_configuration.logging_dir
        self.log_with = resolve_log_with(log_with, self.logging_dir, is_main=self.is_main_process)
        self._tracking = TrackerSet(self.log_with, self.logging_dir)
        self._save_state_pre_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._load_state_pre_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()

    # --- process (distributed_type and is_fsdp2: ShardingChoice, one_process.py) ----------------------

    @property
    def state(self) -> AcceleratorState:
        """Accelerate's ``accelerator.state``: the shared ``AcceleratorState`` (``.fsdp_plugin``, ``.device``, ...,
        ``None`` for the plugin when nothing is sharded), which this accelerator filled; see [Note: reset state]."""
        return self._state

    # [Note: reset state]
    # As in Accelerate, the accelerator's process fields are answered through the shared AcceleratorState: once
    # ``AcceleratorState._reset_state()`` ran (Accelerate's tests do it between tests), they raise Accelerate's
    # AttributeError naming the reset, until a new Accelerator (or PartialState) is built. The process group is
    # the accelerator's own and stays; only the answers stop.
    device = _answered_by_state("device")
    process_index = _answered_by_state("process_index")
    local_process_index = _answered_by_state("local_process_index")
    num_processes = _answered_by_state("num_processes")
    is_main_process = _answered_by_state("is_main_process")
    is_local_main_process = _answered_by_state("is_local_main_process")

    def _mesh_rank(self, dim: str, what: str) -> int:
        if self.parallelism_config is None:
            raise RuntimeError(f"{what} rank: no ParallelismConfig. Pass Accelerator(parallelism_config=...).")
        enabled = dim in self.parallelism_config.active_mesh_dims and self.torch_device_mesh is not None
        return self.torch_device_mesh.get_local_rank(dim) if enabled else 0

    @property
    def tensor_parallel_rank(self) -> int:
        """This rank's position in its tp group (0 without tensor parallelism); needs a ParallelismConfig."""
        return self._mesh_rank("tp", "Tensor parallel")

    @property
    def data_parallel_rank(self) -> int:
        """This rank's replica (``dp_replicate`` position; 0 without replication); needs a ParallelismConfig."""
        return self._mesh_rank("dp_replicate", "Data parallel")

    @property
    def data_parallel_shard_rank(self) -> int:
        """This rank's ``dp_shard`` position (0 without sharding); needs a ParallelismConfig."""
        return self._mesh_rank("dp_shard", "Data parallel shard")

    @property
    def context_parallel_rank(self) -> int:
        raise NotImplementedError("Accelerator.context_parallel_rank: fullshard has no context parallelism.")

    @property
    def pipeline_parallel_rank(self) -> int:
        raise NotImplementedError("Accelerator.pipeline_parallel_rank: fullshard has no pipeline parallelism.")

    @property
    def _models(self) -> list[nn.Module]:
        """The prepared models (Accelerate's private list, which transformers' Trainer reads)."""
        return self._objects.models

    _optimizers = property(lambda self: self._objects.optimizers, doc="The prepared optimizers, in order.")
    _schedulers = property(lambda self: self._objects.schedulers, doc="The prepared schedulers, in order.")
    _dataloaders = property(lambda self: self._objects.dataloaders, doc="The prepared dataloaders, in order.")
    _custom_objects = property(lambda self: self._objects.custom, doc="register_for_checkpointing's objects.")

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    split_batches = property(lambda self: self.dataloader_config.split_batches)
    dispatch_batches = property(lambda self: self.dataloader_config.dispatch_batches)
    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    use_stateful_dataloader = property(lambda self: self.dataloader_config.use_stateful_dataloader)

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        """Change the accumulation length (Accelerate's setter); not in world-size-invariant mode, where the
        plugin's micro-batch count decides it."""
        _check_args(steps, self.fsdp_plugin)
        if self._invariant is not None:
            raise ValueError(
                f"accelerator.gradient_accumulation_steps = {steps}: in world-size-invariant mode the steps per rank "
                f"follow from the plugin's invariant_micro_batches ({self._invariant.micro_batches}); change that."
            )
        self.gradient_state.num_steps = steps

    def set_trigger(self) -> None:
        """Raise this process's stop flag; the next :meth:`check_trigger` is True on every rank."""
        preemption.set_trigger()

    def check_trigger(self) -> bool:
        """True on every rank when any rank set the trigger (or got a preemption signal); a collective.

        See [Note: preemption] in ``preemption.py``; clears the trigger when True.
        """
        return preemption.check_trigger(self.device)

    def end_training(self) -> None:
        """Wait for a background save (raising its failure, before anything else) and free the host buffers async
        saves keep, finish the trackers, wait for every process, then release the process group if this
        Accelerator created it."""
        state_io.release_save_buffers()
        self._tracking.finish()
        self.wait_for_everyone()
        runtime.shutdown()

    # --- prepare ------------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare each argument (models first, then optimizers, then schedulers); return them in order."""
        _check_device_placement(device_placement, "Accelerator.prepare")
        result = list(args)
        for passes in (self._prepare_first, self._prepare_optimizer, self._prepare_scheduler):
            result = [passes(obj) for obj in result]
        for before, after in zip(args, result, strict=True):
            if after is not before or isinstance(after, nn.Module):  # Accelerate marks what it prepared
                after._is_accelerate_prepared = True
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_first(self, obj: Any) -> Any:
        if isinstance(obj, nn.Module):
            return self.prepare_model(obj)
        if isinstance(obj, DataLoader):
            return self.prepare_data_loader(obj)
        return obj

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        """Shard ``model`` as the plugin says (see ``prepare.py``), compile it if the dynamo plugin says so (see
        ``compile.py``), and remember it for checkpoints."""
        _check_device_placement(device_placement, "Accelerator.prepare_model")
        if any(model is known for known in self._objects.models):  # prepared here already: as it is, listed once
            return model
        if self._sharding:
            prepared = prepare_model(model, self.fsdp_plugin, self.device, **self._mesh_options(model))
            ddp.apply_ddp_kwargs(prepared, self._handlers.ddp, is_main=self.is_main_process)
        else:  # [Note: one process without FSDP]: the model as it is, on the device
            prepared = model if is_sharded(model) else model.to(self.device)
        precision = PrecisionType(self.mixed_precision)
        policy = self.fsdp_plugin.mixed_precision_policy if is_sharded(prepared) else None
        autocast = training.needs_autocast(precision, policy)
        training.wrap_forward_for_precision(
            prepared, precision, self.device, autocast=autocast, handler=self._handlers.autocast
        )
        compile_model(prepared, self.dynamo_plugin)
        self._objects.models.append(prepared)
        return prepared

    def _mesh_options(self, model: nn.Module) -> dict[str, Any]:
        """``fully_shard``'s mesh (and the tp mesh plain parameters are replicated over) under a ParallelismConfig;
        see ``parallelism.py``. Refuses a model of another tensor parallel size first."""
        config, mesh = self.parallelism_config, self.torch_device_mesh
        if config is None or mesh is None or is_sharded(model):
            return {}
        check_model_tp(model, config)
        return {"mesh": mesh[tuple(config.fsdp_dim_names)], "tp_mesh": mesh["tp"] if config.tp_enabled else None}

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None) -> DataLoader:
        """This rank's share of ``data_loader``; see [Note: batch dealing] in ``data/sharded_loader.py``."""
        _check_device_placement(device_placement, "Accelerator.prepare_data_loader")
        config = self.dataloader_config
        # Under a ParallelismConfig the ranks of one tp group share a batch (see parallelism.py).
        index, count = data_parallel_position(self.parallelism_config, self.process_index, self.num_processes)
        if config.dispatch_batches:  # rank 0 reads every batch and sends each rank its part
            _check_dispatch(self._invariant is not None, count, self.num_processes)
            prepared = dispatch_loader(
                data_loader, device=self.device, split_batches=config.split_batches, non_blocking=config.non_blocking
            )
            self._objects.dataloaders.append(prepared)
            return prepared
        if self._invariant is None and dealt_as_accelerate(data_loader):  # a stream, or batches of any size
            prepared = shard_loader(
                data_loader, num_processes=count, process_index=index, device=self.device,
                split_batches=config.split_batches, even_batches=config.even_batches,
                non_blocking=config.non_blocking, rng_types=self.rng_types,
            )  # fmt: skip
            self._objects.dataloaders.append(prepared)
            return prepared
        prepared = prepare_data_loader(
            data_loader,
            num_processes=count,
            process_index=index,
            device=self.device,
            gradient_state=self.gradient_state,
            even_batches=config.even_batches,
            split_batches=config.split_batches,
            use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed,
            non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader,
            rng_types=self.rng_types,
            invariant_micro_batches=None if self._invariant is None else self._invariant.micro_batches,
        )
        self._objects.dataloaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
        """``dataloader`` without its first ``num_batches`` batches (resuming mid-epoch; ``data/sharded_loader.py``)."""
        return skip_first_batches(dataloader, num_batches)

    def _prepare_optimizer(self, obj: Any) -> Any:
        if not isinstance(obj, torch.optim.Optimizer) or isinstance(obj, AcceleratedOptimizer):
            return obj
        switch_optimizer_to_sharded(obj)
        whole = bool(self.fsdp_plugin.whole_param_step) and self._sharding  # a model as it is steps whole anyway
        prepare_whole_param_step(obj, self._objects.models, whole)
        wrapped = AcceleratedOptimizer(obj, self.gradient_state, self.scaler)
        self._objects.optimizers.append(wrapped)
        return wrapped

    def _prepare_scheduler(self, obj: Any) -> Any:
        if not (hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "get_last_lr")):
            return obj
        if isinstance(obj, AcceleratedScheduler):
            return obj
        optimizers = [o for o in self._objects.optimizers if o.optimizer is obj.optimizer or o is obj.optimizer]
        # Scheduler steps per optimizer step; world-size-invariant mode: one, on every N (see invariant.py).
        steps = 1 if self.split_batches or self._invariant is not None else self.num_processes
        wrapped = AcceleratedScheduler(obj, optimizers, self.gradient_state, steps, self.step_scheduler_with_optimizer)
        self._objects.schedulers.append(wrapped)
        return wrapped

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

    # --- checkpoints and weights: saving/accelerator_checkpoints.py; the user's module ----------------

    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool | None = None
    ) -> nn.Module:
        """The user's module (``extract_model_from_parallel``). The Accelerator compiles a model in place, so
        ``keep_torch_compile`` (``None``: false, as Accelerate) only matters for a ``torch.compile(...)`` given."""
        return training.extract_model_from_parallel(model, keep_fp32_wrapper, keep_torch_compile)

    # --- trackers (trackers.py) -----------------------------------------------------------------------

    @property
    def trackers(self) -> list[GeneralTracker]:
        return self._tracking.trackers

    def init_trackers(
        self, project_name: str, config: dict[str, Any] | None = None, init_kwargs: dict[str, Any] | None = None
    ) -> None:
        """Start the ``log_with`` trackers under ``<project_dir>/<project_name>/``; record ``config``."""
        self._tracking.start(project_name, config, init_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        return self._tracking.get(name, unwrap)

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        """Log ``values`` to every tracker, from the main process only."""
        self._tracking.log(values, step, log_kwargs, self.is_main_process)

    # --- processes and memory (operations/) ---------------------------------------------------------

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return processes.only_on(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return processes.only_on(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return processes.only_on(function, lambda: self.process_index == self.num_processes - 1)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Any:
        if function is None:
            return lambda f: self.on_process(f, process_index)
        return processes.only_on(function, lambda: self.num_processes == 1 or self.process_index == process_index)

    def on_local_process(self, function: Callable[..., Any] | None = None, local_process_index: int | None = None):
        if function is None:
            return lambda f: self.on_local_process(f, local_process_index)
        index = local_process_index
        return processes.only_on(function, lambda: self.num_processes == 1 or self.local_process_index == index)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Any:
        return processes.split_between_processes(inputs, apply_padding)

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared object (the next ``prepare`` starts afresh) and release their memory; returns
        ``[None] * len(objects)`` for the caller to rebind its names to."""
        scaler = self._objects.scaler
        self._objects = state_io.TrainingObjects(scaler=scaler, gradient_state=self.gradient_state)
        return memory.release_memory(*objects)

    clear = free_memory


_ACCELERATE_ONLY = ("deepspeed_plugin", "deepspeed_plugins", "megatron_lm_plugin", "torch_tp_plugin")


def _refuse_accelerate_only_plugins(kwargs: dict[str, Any]) -> None:
    """Accelerate's DeepSpeed/Megatron/TP-plugin arguments: ``None`` is dropped; a value is refused."""
    for name in _ACCELERATE_ONLY:
        if name in kwargs and kwargs.pop(name) is not None:
            raise TypeError(
                f"Accelerator({name}=...): fullshard is FSDP only (no DeepSpeed or Megatron-LM; tensor parallelism "
                "goes through parallelism_config=ParallelismConfig(tp_size=...)). Leave it None."
            )


def _all_tensors(data: Any) -> bool:
    found: list[bool] = []
    ops.recursively_apply(lambda t: found.append(True), data)
    leaves: list[Any] = []
    ops.recursively_apply(lambda x: leaves.append(x), data, test_type=lambda x: True)
    return bool(found) and len(found) == len(leaves)

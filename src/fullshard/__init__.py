"""fullshard: Fully Sharded Data Parallel training for PyTorch.

This module re-exports the public surface; it holds no logic. The names are imported on first use (PEP 562
``__getattr__``, the table being the ``if TYPE_CHECKING:`` imports): ``import fullshard.cli`` or
``fullshard.engine.api`` alone imports neither the Accelerator nor the engine, so ``fullshard launch``'s own
process starts in torch's import time, not the library's (its ranks import what their script uses).
"""

from typing import TYPE_CHECKING

from fullshard.surface import lazy_surface

if TYPE_CHECKING:  # the table of what is imported from where, read by lazy_surface: imported on first use
    from fullshard.algorithms.checkpointing import apply_activation_checkpointing, checkpoint_module
    from fullshard.algorithms.grad_scaler import ShardedGradScaler
    from fullshard.algorithms.whole_step import register_matrix_optimizer, whole_param_step
    from fullshard.engine import (
        FSDP,
        BackwardPrefetch,
        CPUOffload,
        CPUOffloadPolicy,
        FSDPModule,
        FullOptimStateDictConfig,
        FullStateDictConfig,
        FullyShardedDataParallel,
        LocalOptimStateDictConfig,
        LocalStateDictConfig,
        MixedPrecision,
        MixedPrecisionPolicy,
        OffloadPolicy,
        OptimStateDictConfig,
        OptimStateKeyType,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        ShardingStrategy,
        StateDictConfig,
        StateDictSettings,
        StateDictType,
        UnshardHandle,
        fully_shard,
        register_fsdp_forward_method,
        share_comm_ctx,
    )
    from fullshard.frontend.accelerator import Accelerator
    from fullshard.frontend.bigmodel.empty import init_empty_weights
    from fullshard.frontend.bigmodel.loading import load_checkpoint_in_model
    from fullshard.frontend.bigmodel.sizes import infer_auto_device_map
    from fullshard.frontend.data.dataloader_config import DataLoaderConfiguration
    from fullshard.frontend.data.sharded_loader import skip_first_batches, synchronize_rng_states
    from fullshard.frontend.enums import DistributedType
    from fullshard.frontend.handlers import (
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
    )
    from fullshard.frontend.memory import find_executable_batch_size
    from fullshard.frontend.parallelism import ParallelismConfig
    from fullshard.frontend.plugin import FullyShardedDataParallelPlugin
    from fullshard.frontend.project import ProjectConfiguration

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FSDP",
    "FSDPModule",
    "FullyShardedDataParallel",
    "FullyShardedDataParallelPlugin",
    "FullOptimStateDictConfig",
    "InitProcessGroupKwargs",
    "GradScalerKwargs",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ParallelismConfig",
    "ProfileKwargs",
    "ProjectConfiguration",
    "ShardedOptimStateDictConfig",
    "ShardedGradScaler",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "apply_activation_checkpointing",
    "checkpoint_module",
    "find_executable_batch_size",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "UnshardHandle",
    "infer_auto_device_map",
    "init_empty_weights",
    "load_checkpoint_in_model",
    "register_matrix_optimizer",
    "skip_first_batches",
    "synchronize_rng_states",
    "whole_param_step",
]

__getattr__, __dir__ = lazy_surface(__name__, __file__)

"""fullshard: Fully Sharded Data Parallel training for PyTorch.

This module re-exports the public surface; it holds no logic.
"""

from fullshard.engine.api import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullOptimStateDictConfig,
    FullStateDictConfig,
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
)
from fullshard.engine.checkpointing import apply_activation_checkpointing, checkpoint_module
from fullshard.engine.fully_shard import FSDPModule, fully_shard
from fullshard.engine.grad_scaler import ShardedGradScaler
from fullshard.engine.wrapper import FSDP, FullyShardedDataParallel
from fullshard.frontend.accelerator import Accelerator
from fullshard.frontend.plugin import FullyShardedDataParallelPlugin
from fullshard.frontend.project import ProjectConfiguration

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "FSDP",
    "FSDPModule",
    "FullyShardedDataParallel",
    "FullyShardedDataParallelPlugin",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
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
    "fully_shard",
]

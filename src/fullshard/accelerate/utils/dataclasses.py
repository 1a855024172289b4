"""``accelerate.utils.dataclasses``: fullshard's plugins and kwargs handlers; DeepSpeed's classes are refused."""

from fullshard.frontend.plugin import get_module_class_from_name
from fullshard.frontend.handlers import AutocastKwargs
from fullshard.frontend.refused import refused_class
from fullshard.utils import (
    ComputeEnvironment,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    LoggerType,
    PrecisionType,
    ProfileKwargs,
    ProjectConfiguration,
    RNGType,
    TorchDynamoPlugin,
    TorchTensorParallelConfig,
)

_WHY = "fullshard is FSDP only (no DeepSpeed)"
DeepSpeedPlugin = refused_class("DeepSpeedPlugin", _WHY)
DeepSpeedSchedulerWrapper = refused_class("DeepSpeedSchedulerWrapper", _WHY)
DeepSpeedSequenceParallelConfig = refused_class("DeepSpeedSequenceParallelConfig", _WHY)
FP8RecipeKwargs = refused_class("FP8RecipeKwargs", 'fullshard refuses mixed_precision="fp8"; use "bf16" or "fp16"')
TorchContextParallelConfig = refused_class(
    "TorchContextParallelConfig", "fullshard has no context parallelism (its ParallelismConfig has dp and tp)"
)

__all__ = [
    "ComputeEnvironment",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DeepSpeedSchedulerWrapper",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "get_module_class_from_name",
    "AutocastKwargs",
    "DeepSpeedSequenceParallelConfig",
    "FP8RecipeKwargs",
    "TorchContextParallelConfig",
]

"""``accelerate.utils``: every name of ``fullshard.utils``, the per-object FSDP checkpoint functions, and
stand-ins for DeepSpeed's classes (refused when built)."""

from fullshard.accelerate.utils.constants import FSDP_MODEL_NAME
from fullshard.accelerate.utils.dataclasses import (
    AutocastKwargs,
    DeepSpeedPlugin,
    DeepSpeedSchedulerWrapper,
    DeepSpeedSequenceParallelConfig,
    FP8RecipeKwargs,
    TorchContextParallelConfig,
)
from fullshard.accelerate.utils.environment import (
    check_os_kernel,
    clear_environment,
    convert_dict_to_env_variables,
    purge_accelerate_environment,
)
from fullshard.accelerate.utils.fsdp_utils import (
    compile_regions_fsdp2,
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)
from fullshard.accelerate.utils.imports import is_deepspeed_available, is_import_timer_available
from fullshard.accelerate.utils.memory import clear_device_cache, should_reduce_batch_size
from fullshard.accelerate.utils.modeling import get_state_dict_from_offload, has_offloaded_params
from fullshard.accelerate.utils.operations import (
    CannotPadNestedTensorWarning,
    convert_outputs_to_fp32,
    find_device,
    is_namedtuple,
    pad_input_tensors,
)
from fullshard.accelerate.utils.other import compile_regions, has_compiled_regions, is_compiled_module
from fullshard.utils import *  # noqa: F403
from fullshard.utils import __all__ as _fullshard_utils

__all__ = [
    *_fullshard_utils,
    "DeepSpeedPlugin",
    "DeepSpeedSchedulerWrapper",
    "FSDP_MODEL_NAME",
    "clear_device_cache",
    "is_deepspeed_available",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "save_fsdp_model",
    "save_fsdp_optimizer",
    "should_reduce_batch_size",
    "AutocastKwargs",
    "CannotPadNestedTensorWarning",
    "DeepSpeedSequenceParallelConfig",
    "FP8RecipeKwargs",
    "TorchContextParallelConfig",
    "check_os_kernel",
    "clear_environment",
    "compile_regions",
    "compile_regions_fsdp2",
    "convert_dict_to_env_variables",
    "convert_outputs_to_fp32",
    "find_device",
    "get_state_dict_from_offload",
    "has_compiled_regions",
    "has_offloaded_params",
    "is_compiled_module",
    "is_import_timer_available",
    "is_namedtuple",
    "pad_input_tensors",
    "purge_accelerate_environment",
]

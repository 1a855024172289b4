"""``fullshard.utils``: Accelerate-compatible utilities (re-exports only)."""

from fullshard.checkpoint import (
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    merge_fsdp_weights,
)
from fullshard.checkpoint.rotation import latest_checkpoint
from fullshard.cli.basic_config import write_basic_config
from fullshard.frontend.adapters import is_peft_model
from fullshard.frontend.availability import (
    is_bf16_available,
    is_cuda_available,
    is_datasets_available,
    is_hpu_available,
    is_mlu_available,
    is_mps_available,
    is_musa_available,
    is_npu_available,
    is_peft_available,
    is_rich_available,
    is_schedulefree_available,
    is_sdaa_available,
    is_tensorboard_available,
    is_torch_xla_available,
    is_transformers_available,
    is_wandb_available,
    is_xpu_available,
)
from fullshard.frontend.bigmodel.loading import load_checkpoint_in_model, load_state_dict, shard_checkpoint
from fullshard.frontend.bigmodel.offload import load_offloaded_weights, offload_state_dict
from fullshard.frontend.bigmodel.sizes import (
    compute_module_sizes,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
    infer_auto_device_map,
)
from fullshard.frontend.bigmodel.tensors import named_module_tensors, set_module_tensor_to_device
from fullshard.frontend.bigmodel.tied import (
    check_tied_parameters_on_same_device,
    find_tied_parameters,
    retie_parameters,
)
from fullshard.frontend.compile import TorchDynamoPlugin
from fullshard.frontend.data import synchronize_rng_state, synchronize_rng_states
from fullshard.frontend.dataloader_config import DataLoaderConfiguration
from fullshard.frontend.enums import (
    ComputeEnvironment,
    DistributedType,
    DynamoBackend,
    PrecisionType,
    RNGType,
    SageMakerDistributedType,
)
from fullshard.frontend.handlers import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)
from fullshard.frontend.handlers.base import KwargsHandler
from fullshard.frontend.launch_helpers import PrepareForLaunch, patch_environment
from fullshard.frontend.memory import find_executable_batch_size, release_memory
from fullshard.frontend.ops import (
    broadcast,
    broadcast_object_list,
    concatenate,
    convert_to_fp32,
    gather,
    gather_object,
    listify,
    pad_across_processes,
    recursively_apply,
    reduce,
    save,
    send_to_device,
    set_seed,
    slice_tensors,
    wait_for_everyone,
)
from fullshard.frontend.parallelism import ParallelismConfig, TorchTensorParallelConfig
from fullshard.frontend.plugin import FullyShardedDataParallelPlugin
from fullshard.frontend.preemption import install_preemption_handler, preemption_signal
from fullshard.frontend.prepare import (
    disable_fsdp_ram_efficient_loading,
    enable_fsdp_ram_efficient_loading,
    fsdp2_load_full_state_dict,
    fsdp2_prepare_auto_wrap_policy,
    fsdp2_prepare_model,
    fsdp2_switch_optimizer_parameters,
)
from fullshard.frontend.process_output import tqdm
from fullshard.frontend.project import ProjectConfiguration
from fullshard.frontend.refused import DummyOptim, DummyScheduler, MegatronLMDummyScheduler
from fullshard.frontend.tracking import LoggerType
from fullshard.frontend.training import extract_model_from_parallel
from fullshard.frontend.versions import compare_versions, get_pretty_name, is_torch_version

__all__ = [
    "ComputeEnvironment",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "DynamoBackend",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "KwargsHandler",
    "LoggerType",
    "MODEL_NAME",
    "MegatronLMDummyScheduler",
    "OPTIMIZER_NAME",
    "PrecisionType",
    "ParallelismConfig",
    "PrepareForLaunch",
    "ProfileKwargs",
    "RNGType",
    "RNG_STATE_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "SageMakerDistributedType",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "InitProcessGroupKwargs",
    "ProjectConfiguration",
    "broadcast",
    "broadcast_object_list",
    "check_tied_parameters_on_same_device",
    "compare_versions",
    "compute_module_sizes",
    "concatenate",
    "convert_to_fp32",
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "extract_model_from_parallel",
    "find_executable_batch_size",
    "find_tied_parameters",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_auto_wrap_policy",
    "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters",
    "gather",
    "gather_object",
    "install_preemption_handler",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "get_pretty_name",
    "infer_auto_device_map",
    "is_bf16_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_hpu_available",
    "is_mlu_available",
    "is_mps_available",
    "is_musa_available",
    "is_npu_available",
    "is_peft_available",
    "is_peft_model",
    "is_rich_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_tensorboard_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_transformers_available",
    "is_wandb_available",
    "is_xpu_available",
    "listify",
    "named_module_tensors",
    "load_checkpoint_in_model",
    "load_offloaded_weights",
    "load_state_dict",
    "latest_checkpoint",
    "merge_fsdp_weights",
    "offload_state_dict",
    "pad_across_processes",
    "patch_environment",
    "preemption_signal",
    "recursively_apply",
    "reduce",
    "release_memory",
    "retie_parameters",
    "save",
    "send_to_device",
    "set_module_tensor_to_device",
    "set_seed",
    "shard_checkpoint",
    "slice_tensors",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "tqdm",
    "wait_for_everyone",
    "write_basic_config",
]

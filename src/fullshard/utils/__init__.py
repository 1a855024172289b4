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
from fullshard.frontend.modules import compute_module_sizes, find_executable_batch_size
from fullshard.frontend.ops import (
    broadcast,
    broadcast_object_list,
    concatenate,
    gather,
    gather_object,
    pad_across_processes,
    recursively_apply,
    reduce,
    save,
    send_to_device,
    set_seed,
    wait_for_everyone,
)
from fullshard.frontend.prepare import (
    disable_fsdp_ram_efficient_loading,
    enable_fsdp_ram_efficient_loading,
    fsdp2_load_full_state_dict,
    fsdp2_prepare_auto_wrap_policy,
    fsdp2_prepare_model,
    fsdp2_switch_optimizer_parameters,
)
from fullshard.frontend.project import ProjectConfiguration
from fullshard.frontend.training import extract_model_from_parallel
from fullshard.frontend.types import DistributedType, PrecisionType

__all__ = [
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "RNG_STATE_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "DistributedType",
    "PrecisionType",
    "ProjectConfiguration",
    "broadcast",
    "broadcast_object_list",
    "compute_module_sizes",
    "concatenate",
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "extract_model_from_parallel",
    "find_executable_batch_size",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_auto_wrap_policy",
    "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters",
    "gather",
    "gather_object",
    "latest_checkpoint",
    "merge_fsdp_weights",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "save",
    "send_to_device",
    "set_seed",
    "wait_for_everyone",
]

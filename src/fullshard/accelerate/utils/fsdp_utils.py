"""``accelerate.utils.fsdp_utils``: per-object FSDP checkpoints, FSDP2 preparation helpers, the weight merge."""

from fullshard.frontend.compile import compile_regions_fsdp2, is_compiled_module
from fullshard.frontend.prepare import get_parameters_from_modules
from fullshard.frontend.saving.fsdp_checkpoints import (
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)
from fullshard.utils import (
    disable_fsdp_ram_efficient_loading,
    enable_fsdp_ram_efficient_loading,
    fsdp2_load_full_state_dict,
    fsdp2_prepare_auto_wrap_policy,
    fsdp2_prepare_model,
    fsdp2_switch_optimizer_parameters,
    merge_fsdp_weights,
)

__all__ = [
    "compile_regions_fsdp2",
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_auto_wrap_policy",
    "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters",
    "get_parameters_from_modules",
    "is_compiled_module",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "merge_fsdp_weights",
    "save_fsdp_model",
    "save_fsdp_optimizer",
]

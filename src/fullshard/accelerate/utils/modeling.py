"""``accelerate.utils.modeling``: module sizes and device maps for one process; ``clean_device_map`` is refused."""

from torch import nn

from fullshard.frontend.refused import refused_function
from fullshard.utils import (
    compute_module_sizes,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
    infer_auto_device_map,
    is_peft_model,
    load_checkpoint_in_model,
    load_state_dict,
    named_module_tensors,
    set_module_tensor_to_device,
)

clean_device_map = refused_function(
    "clean_device_map", "fullshard shards models across processes instead of dispatching them over devices"
)

get_state_dict_from_offload = refused_function(
    "get_state_dict_from_offload", "fullshard shards models across processes instead of offloading them with hooks"
)


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether Accelerate's offload hook (``module._hf_hook`` with ``offload=True``) is attached to ``module``;
    fullshard attaches none, so only a hook put there by other code counts."""
    return getattr(getattr(module, "_hf_hook", None), "offload", False) is True


__all__ = [
    "clean_device_map",
    "compute_module_sizes",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "infer_auto_device_map",
    "is_peft_model",
    "load_checkpoint_in_model",
    "load_state_dict",
    "named_module_tensors",
    "set_module_tensor_to_device",
    "get_state_dict_from_offload",
    "has_offloaded_params",
]

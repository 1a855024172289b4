"""``accelerate.utils.modeling``: module sizes and device maps for one process; ``clean_device_map`` is refused."""

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
]

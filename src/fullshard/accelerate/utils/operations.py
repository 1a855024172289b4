"""``accelerate.utils.operations``: collectives and nested-structure helpers."""

from fullshard.frontend.ops import (
    CannotPadNestedTensorWarning,
    convert_outputs_to_fp32,
    find_device,
    is_namedtuple,
    pad_input_tensors,
)
from fullshard.utils import (
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
    send_to_device,
    slice_tensors,
)

__all__ = [
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "convert_to_fp32",
    "gather",
    "gather_object",
    "listify",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "slice_tensors",
    "CannotPadNestedTensorWarning",
    "convert_outputs_to_fp32",
    "find_device",
    "is_namedtuple",
    "pad_input_tensors",
]

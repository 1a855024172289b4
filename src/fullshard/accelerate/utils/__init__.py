"""``accelerate.utils``: every name of ``fullshard.utils``, the per-object FSDP checkpoint functions, and
stand-ins for DeepSpeed's classes (refused when built)."""

from fullshard.accelerate.utils.constants import FSDP_MODEL_NAME
from fullshard.accelerate.utils.dataclasses import DeepSpeedPlugin, DeepSpeedSchedulerWrapper
from fullshard.accelerate.utils.fsdp_utils import (
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)
from fullshard.accelerate.utils.imports import is_deepspeed_available
from fullshard.accelerate.utils.memory import clear_device_cache, should_reduce_batch_size
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
]

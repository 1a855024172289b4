"""``accelerate.utils.other``."""

from fullshard.frontend.compile import compile_regions, has_compiled_regions, is_compiled_module
from fullshard.frontend.launch_helpers import check_os_kernel
from fullshard.utils import extract_model_from_parallel, get_pretty_name, patch_environment, save, wait_for_everyone

__all__ = [
    "extract_model_from_parallel",
    "get_pretty_name",
    "has_compiled_regions",
    "is_compiled_module",
    "patch_environment",
    "save",
    "wait_for_everyone",
    "check_os_kernel",
    "compile_regions",
]

"""``accelerate.utils.other``."""

from fullshard.frontend.compile import has_compiled_regions, is_compiled_module
from fullshard.utils import extract_model_from_parallel, get_pretty_name, patch_environment, save, wait_for_everyone

__all__ = [
    "extract_model_from_parallel",
    "get_pretty_name",
    "has_compiled_regions",
    "is_compiled_module",
    "patch_environment",
    "save",
    "wait_for_everyone",
]

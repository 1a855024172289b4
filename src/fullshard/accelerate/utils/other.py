"""``accelerate.utils.other``."""

from fullshard.utils import extract_model_from_parallel, get_pretty_name, patch_environment, save, wait_for_everyone

__all__ = ["extract_model_from_parallel", "get_pretty_name", "patch_environment", "save", "wait_for_everyone"]

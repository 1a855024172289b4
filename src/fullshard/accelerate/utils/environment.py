"""``accelerate.utils.environment``: helpers for the process environment."""

from fullshard.frontend.launch_helpers import (
    check_os_kernel,
    clear_environment,
    convert_dict_to_env_variables,
    patch_environment,
    purge_accelerate_environment,
)

__all__ = [
    "check_os_kernel",
    "clear_environment",
    "convert_dict_to_env_variables",
    "patch_environment",
    "purge_accelerate_environment",
]

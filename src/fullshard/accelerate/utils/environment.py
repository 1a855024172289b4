"""``accelerate.utils.environment``: helpers for the process environment.

``convert_dict_to_env_variables`` warns on the logger ``accelerate.utils.environment``, where Accelerate's does
(tests and scripts filter or capture its warnings by that name).
"""

import logging

from fullshard.frontend import launch_helpers
from fullshard.frontend.launch_helpers import (
    check_os_kernel,
    clear_environment,
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

_logger = logging.getLogger("accelerate.utils.environment")


def convert_dict_to_env_variables(current_env: dict[str, str]) -> list[str]:
    """``KEY=value\\n`` lines for an environment file; a key or value that is empty or holds ``; < >``, a space or
    a newline is left out, with a warning on the logger ``accelerate.utils.environment``."""
    return launch_helpers.convert_dict_to_env_variables(current_env, logger=_logger)

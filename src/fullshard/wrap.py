"""``fullshard.wrap``: auto-wrap policies and manual wrapping (re-exports only)."""

from fullshard.engine import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

"""Version comparisons (``is_torch_version``, ``compare_versions``) and ``get_pretty_name``.

Versions compare as PEP 440 versions (torch's vendored ``packaging``, through ``TorchVersion``), local labels
included: with torch ``2.13.0+cpu`` installed, ``is_torch_version("==", "2.13.0")`` is ``False`` and
``is_torch_version(">", "2.13.0")`` is ``True``, as in Accelerate.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import operator
from typing import Any

from torch.torch_version import TorchVersion

__all__ = ["compare_versions", "get_pretty_name", "is_torch_version"]

_OPERATIONS = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<=": operator.le,
               "<": operator.lt}  # fmt: skip


def compare_versions(library_or_version: str, operation: str, requirement_version: str) -> bool:
    """``<version> <operation> <requirement_version>``; a name that is an installed distribution means its version."""
    if operation not in _OPERATIONS:
        raise ValueError(f"compare_versions(operation={operation!r}): expected one of {list(_OPERATIONS)}.")
    version = str(library_or_version)
    with contextlib.suppress(importlib.metadata.PackageNotFoundError, ValueError):  # else: a version string
        version = importlib.metadata.version(version)
    return bool(_OPERATIONS[operation](TorchVersion(version), str(requirement_version)))


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch's version with ``version`` (e.g. ``is_torch_version(">=", "2.4")``)."""
    return compare_versions("torch", operation, version)


def get_pretty_name(obj: Any) -> str:
    """``obj``'s qualified name, or its class's for an instance, else ``str(obj)``."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return str(getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or obj)

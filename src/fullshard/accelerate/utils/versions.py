"""``accelerate.utils.versions``."""

from fullshard.utils import compare_versions, is_torch_version

__all__ = ["compare_versions", "is_torch_version"]

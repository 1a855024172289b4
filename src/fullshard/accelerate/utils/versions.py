"""``accelerate.utils.versions``: version comparisons."""

from fullshard.frontend.versions import compare_versions, is_torch_version

__all__ = ["compare_versions", "is_torch_version"]

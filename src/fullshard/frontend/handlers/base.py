"""``KwargsHandler``: the base of Accelerate's handler dataclasses (``to_kwargs`` = the fields set by the user)."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["KwargsHandler"]


class KwargsHandler:
    """Mixin for a dataclass whose fields are keyword arguments of some torch object."""

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict[str, Any]:
        """The fields whose values differ from the class defaults (what the user asked for)."""
        default = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if default.get(k) != v}

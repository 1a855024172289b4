"""Turn user-facing enum arguments into our enums.

Accepted for every enum argument: our member, a member of any enum with the same member names (torch's
``torch.distributed.fsdp`` enums, Accelerate's), or the member name as a string in any case. Integers are
accepted where torch's and Accelerate's configs use them (``sharding_strategy: 1`` in a YAML file).
"""

from __future__ import annotations

import contextlib
import enum
from typing import TypeVar

E = TypeVar("E", bound=enum.Enum)


def coerce_enum(value: object, enum_cls: type[E], *, arg: str, allow_int: bool = False) -> E:
    """Return the member of ``enum_cls`` that ``value`` names.

    Raises ``ValueError`` naming ``arg``, the value received and the valid choices.
    """
    if isinstance(value, enum_cls):
        return value
    name = value.name if isinstance(value, enum.Enum) else value
    if isinstance(name, str):
        key = name.strip().upper()
        # Accept "ShardingStrategy.FULL_SHARD" as well as "FULL_SHARD".
        key = key.rsplit(".", 1)[-1]
        if key in enum_cls.__members__:
            return enum_cls[key]
    if allow_int and isinstance(value, int) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):  # no member has this value
            return enum_cls(value)
    choices = ", ".join(enum_cls.__members__)
    raise ValueError(f"{arg}={value!r} is not a {enum_cls.__name__}; expected one of: {choices}.")


def coerce_optional_enum(value: object, enum_cls: type[E], *, arg: str, allow_int: bool = False) -> E | None:
    """As :func:`coerce_enum`, but ``None`` (and the strings "none"/"no") stay ``None``."""
    if value is None or (isinstance(value, str) and value.strip().upper() in ("NONE", "NO", "NO_PREFETCH")):
        return None
    return coerce_enum(value, enum_cls, arg=arg, allow_int=allow_int)

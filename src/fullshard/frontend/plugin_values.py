"""Values of the plugin's fields: what users pass (strings, numbers, bools, torch's objects) → typed values.

Pure functions, one per kind of field, each raising an error that names the field, the value received and
the valid choices ("FullyShardedDataParallelPlugin.<field>=<value>: what is wrong. How to fix it.").
:mod:`fullshard.frontend.plugin` applies them; string choices go through the table of
:mod:`fullshard.frontend.env`, so a name accepted in the environment is accepted as an argument too.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fullshard.engine import (
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    coerce_enum,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from fullshard.frontend import env

__all__ = [
    "MIXED_PRECISION_DTYPES",
    "PLUGIN",
    "coerce_config",
    "error",
    "parse_auto_wrap_policy",
    "parse_choice",
    "parse_cpu_offload",
    "parse_dtype",
    "parse_ignored_modules",
    "parse_min_num_params",
    "parse_names",
    "parse_version",
    "policy_from_dict",
    "to_strategy",
]

PLUGIN = "FullyShardedDataParallelPlugin"
MIXED_PRECISION_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}
_DTYPE_ALIASES: dict[str, torch.dtype] = {
    **MIXED_PRECISION_DTYPES,
    **{str(d).removeprefix("torch."): d for d in MIXED_PRECISION_DTYPES.values()},
}


def error(field: str, value: object, problem: str, fix: str, cls: type[Exception] = ValueError) -> Exception:
    """The exception for a bad field value, in the package's message form."""
    return cls(f"{PLUGIN}.{field}={value!r}: {problem}. {fix}")


def parse_version(value: object) -> int:
    """``fsdp_version``: 1 or 2 (``None``: :data:`env.DEFAULT_FSDP_VERSION`, 1 as in Accelerate)."""
    if value is None:
        return env.DEFAULT_FSDP_VERSION
    return env.by_field("fsdp_version").parse(value, where=f"{PLUGIN}.fsdp_version")


def parse_choice(field: str, value: object, enum_cls: type[Any]) -> Any:
    """A string/number through the env table's choices, or an enum (ours or a same-named one) → our enum."""
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        name = env.by_field(field).parse(value, where=f"{PLUGIN}.{field}")
        return None if name == "NO_PREFETCH" else next(m for m in enum_cls if m.name.lstrip("_") == name)
    return coerce_enum(value, enum_cls, arg=f"{PLUGIN}.{field}")


def to_strategy(field: str, value: object) -> ShardingStrategy:
    """A sharding strategy, or a reshard-after-forward bool (True ↔ FULL_SHARD, False ↔ SHARD_GRAD_OP)."""
    if env.is_bool_text(value):
        resharded = env.parse_bool(value)
        return ShardingStrategy.FULL_SHARD if resharded else ShardingStrategy.SHARD_GRAD_OP
    return parse_choice(field, value, ShardingStrategy)


def parse_auto_wrap_policy(value: object) -> Callable[..., Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        name = env.by_field("auto_wrap_policy").parse(value, where=f"{PLUGIN}.auto_wrap_policy")
        return {
            "TRANSFORMER_BASED_WRAP": transformer_auto_wrap_policy,
            "SIZE_BASED_WRAP": size_based_auto_wrap_policy,
        }.get(name)
    if callable(value):
        return value
    raise error(
        "auto_wrap_policy",
        value,
        "not a policy",
        'Pass "transformer_based_wrap", "size_based_wrap", "no_wrap" or a callable (module, recurse, numel) -> bool.',
        TypeError,
    )


def parse_cpu_offload(value: object, version: int) -> CPUOffload | OffloadPolicy:
    """A bool, ``CPUOffload`` or ``(CPU)OffloadPolicy`` (ours or torch's) → the object ``version`` takes."""
    if value is None or env.is_bool_text(value):
        offload = value is not None and env.parse_bool(value)
    else:
        config = coerce_config("cpu_offload", value, (CPUOffload, CPUOffloadPolicy, OffloadPolicy))
        if isinstance(config, CPUOffload if version == 1 else OffloadPolicy):
            return config
        offload = isinstance(config, CPUOffloadPolicy) or getattr(config, "offload_params", False)
    if version == 1:
        return CPUOffload(offload_params=offload)
    return CPUOffloadPolicy() if offload else OffloadPolicy()


def parse_ignored_modules(value: object) -> list[nn.Module] | str | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as exc:
            raise error(
                "ignored_modules", value, f"not a valid regular expression ({exc})", "Fix the pattern."
            ) from None
        return value
    if isinstance(value, nn.Module):
        return [value]
    items = list(value) if isinstance(value, Iterable) else [value]
    if not all(isinstance(m, nn.Module) for m in items):
        raise error(
            "ignored_modules",
            value,
            "not modules",
            "Pass an iterable of nn.Module or a regex string matched against module names.",
            TypeError,
        )
    return items


def parse_names(value: object) -> list[str] | None:
    if value is None:
        return None
    return env.by_field("transformer_cls_names_to_wrap").parse(value, where=f"{PLUGIN}.transformer_cls_names_to_wrap")


def parse_min_num_params(value: object) -> int | None:
    if value is None:
        return None
    number = env.by_field("min_num_params").parse(value, where=f"{PLUGIN}.min_num_params")
    if number < 0:
        raise error("min_num_params", value, "negative", "Pass 0 (no wrapping) or a positive number of parameters.")
    return number


def coerce_config(field: str, value: object, classes: tuple[type, ...]) -> Any:
    """Ours as is; torch's config of the same class name → ours, copying the fields by name."""
    if isinstance(value, classes):
        return value
    for cls in classes:
        if type(value).__name__ == cls.__name__:
            names = [f.name for f in dataclasses.fields(cls)]
            return cls(**{n: getattr(value, n) for n in names if hasattr(value, n)})
    expected = " or ".join(c.__name__ for c in classes)
    raise error(field, value, f"not a {expected}", f"Pass a fullshard (or torch) {expected}.", TypeError)


def parse_dtype(field: str, value: object) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in MIXED_PRECISION_DTYPES.values():
        return value
    if isinstance(value, str) and value.strip().lower().removeprefix("torch.") in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[value.strip().lower().removeprefix("torch.")]
    raise error(
        field, value, "not a mixed precision", f"Use one of {', '.join(MIXED_PRECISION_DTYPES)} or the torch dtype."
    )


def policy_from_dict(policy: dict[str, Any], version: int) -> MixedPrecision | MixedPrecisionPolicy:
    cls = MixedPrecision if version == 1 else MixedPrecisionPolicy
    names = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    unknown = sorted(set(policy) - set(names))
    if unknown:
        raise error(
            "mixed_precision_policy",
            policy,
            f"unknown keys {unknown} for fsdp_version={version}",
            f"Use keys among {', '.join(names)}.",
        )
    kwargs = {
        k: parse_dtype(f"mixed_precision_policy[{k!r}]", v) if k.endswith("_dtype") and v is not None else v
        for k, v in policy.items()
    }
    return cls(**kwargs)

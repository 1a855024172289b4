"""Accelerate's small enums: which distributed setup a run is in, and which precision it computes in."""

from __future__ import annotations

import enum

__all__ = ["DistributedType", "PrecisionType"]


class DistributedType(str, enum.Enum):
    """The kind of run (Accelerate's names; the value equals the name, so ``== "FSDP"`` works).

    fullshard itself only produces ``NO`` (one process, no sharding needed), ``MULTI_CPU`` / ``MULTI_GPU``
    (several processes without a plugin; the model is still sharded) and ``FSDP``; the other members exist so
    that code comparing against them keeps working.
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    TPU = "TPU"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"


class PrecisionType(str, enum.Enum):
    """Compute precision: ``no`` (fp32), ``fp16`` or ``bf16`` (Accelerate's values, lower case)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"

    @classmethod
    def parse(cls, value: object, *, arg: str = "mixed_precision") -> PrecisionType:
        """``None``/"no"/"fp32" → NO; "fp16"/"bf16" (any case) or a member → that member."""
        if value is None:
            return cls.NO
        if isinstance(value, cls):
            return value
        text = value.strip().lower() if isinstance(value, str) else None
        if text in ("no", "fp32", "none"):
            return cls.NO
        if text in ("fp16", "bf16"):
            return cls(text)
        raise ValueError(f'{arg}={value!r}: not a precision. Use one of "no", "fp16", "bf16".')

"""Accelerate's enums, with Accelerate's values, and what each means for fullshard.

- :class:`DistributedType`: which distributed setup a run is in; :class:`PrecisionType`: the compute precision.
- :class:`RNGType`: the random states a prepared loader synchronises from rank 0 each epoch. fullshard
  honours ``torch``, ``cuda`` and ``generator`` (``Accelerator(rng_types=[RNGType.TORCH, ...])``); the others
  name devices fullshard does not run on and are refused by the Accelerator.
- :class:`ComputeEnvironment`, :class:`SageMakerDistributedType`: config-file values. fullshard runs on the local
  machine(s) it is launched on (``LOCAL_MACHINE``); SageMaker launching does not apply.
- :class:`DynamoBackend`: ``torch.compile`` backends, for ``Accelerator(dynamo_backend=...)`` and
  :class:`~fullshard.frontend.compile.TorchDynamoPlugin`.

Members compare equal to their string values (``str`` enums). As in Accelerate, ``str()`` of a ``DynamoBackend``
or ``RNGType`` member is its value and ``"torch" in RNGType`` tests a value; the two config enums print as
``ComputeEnvironment.LOCAL_MACHINE``.
"""

from __future__ import annotations

import enum

__all__ = [
    "ComputeEnvironment",
    "ContainsByValue",
    "DistributedType",
    "DynamoBackend",
    "PrecisionType",
    "RNGType",
    "SageMakerDistributedType",
]


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


class ContainsByValue(enum.EnumMeta):
    """Enum metaclass: ``value in EnumClass`` is True for a member's value, as Accelerate's enums allow."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class _ListedEnum(str, enum.Enum, metaclass=ContainsByValue):
    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


class ComputeEnvironment(str, enum.Enum):
    """Where the run computes (a config file's ``compute_environment``)."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class SageMakerDistributedType(str, enum.Enum):
    """SageMaker's own data- or model-parallel libraries (not used by fullshard)."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class DynamoBackend(_ListedEnum):
    """``torch.compile`` backend names (Accelerate's list)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class RNGType(_ListedEnum):
    """Random number generators that can be synchronised across processes."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"

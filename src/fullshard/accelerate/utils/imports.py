"""``accelerate.utils.imports``: availability checks; DeepSpeed is never available here."""

from fullshard.utils import (
    is_bf16_available,
    is_cuda_available,
    is_datasets_available,
    is_hpu_available,
    is_mlu_available,
    is_mps_available,
    is_musa_available,
    is_npu_available,
    is_peft_available,
    is_rich_available,
    is_sdaa_available,
    is_tensorboard_available,
    is_torch_xla_available,
    is_transformers_available,
    is_wandb_available,
    is_xpu_available,
)


def is_deepspeed_available() -> bool:
    """``False``: fullshard's ``accelerate`` has no DeepSpeed path, whatever is installed."""
    return False


__all__ = [
    "is_bf16_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_hpu_available",
    "is_mlu_available",
    "is_mps_available",
    "is_musa_available",
    "is_npu_available",
    "is_peft_available",
    "is_rich_available",
    "is_sdaa_available",
    "is_tensorboard_available",
    "is_torch_xla_available",
    "is_transformers_available",
    "is_wandb_available",
    "is_xpu_available",
]

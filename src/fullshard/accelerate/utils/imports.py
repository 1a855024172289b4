"""``accelerate.utils.imports``: availability checks; DeepSpeed is never available here."""

import importlib.util

from fullshard.utils import (
    is_aim_available,
    is_bf16_available,
    is_clearml_available,
    is_comet_ml_available,
    is_cuda_available,
    is_datasets_available,
    is_dvclive_available,
    is_fp8_available,
    is_fp16_available,
    is_hpu_available,
    is_matplotlib_available,
    is_mlflow_available,
    is_mlu_available,
    is_mps_available,
    is_musa_available,
    is_npu_available,
    is_peft_available,
    is_pandas_available,
    is_pytest_available,
    is_rich_available,
    is_sdaa_available,
    is_swanlab_available,
    is_tensorboard_available,
    is_torch_xla_available,
    is_torchao_available,
    is_torchdata_stateful_dataloader_available,
    is_trackio_available,
    is_transformers_available,
    is_wandb_available,
    is_xpu_available,
)


def is_import_timer_available() -> bool:
    return importlib.util.find_spec("import_timer") is not None


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
    "is_aim_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_dvclive_available",
    "is_fp16_available",
    "is_fp8_available",
    "is_matplotlib_available",
    "is_mlflow_available",
    "is_pandas_available",
    "is_pytest_available",
    "is_swanlab_available",
    "is_torchao_available",
    "is_torchdata_stateful_dataloader_available",
    "is_trackio_available",
    "is_import_timer_available",
]

"""Accelerate's ``is_*_available`` checks: which devices this process can use and which packages are installed.

Device checks ask torch (``torch.xpu``, ``torch.npu`` exist only in builds or plugins that support them);
package checks look the package up without importing it. Every check is cheap and has no side effect.
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = [
    "is_aim_available",
    "is_bf16_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_dvclive_available",
    "is_fp16_available",
    "is_fp8_available",
    "is_hpu_available",
    "is_matplotlib_available",
    "is_mlflow_available",
    "is_mlu_available",
    "is_mps_available",
    "is_musa_available",
    "is_npu_available",
    "is_peft_available",
    "is_pandas_available",
    "is_pytest_available",
    "is_rich_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_torchdata_stateful_dataloader_available",
    "is_trackio_available",
    "is_transformers_available",
    "is_wandb_available",
    "is_xpu_available",
]


def _package(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _device(name: str) -> bool:
    module = getattr(torch, name, None)
    available = getattr(module, "is_available", None)
    return bool(available()) if callable(available) else False


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def is_xpu_available(check_device: bool = False) -> bool:
    return _device("xpu")


def is_npu_available(check_device: bool = False) -> bool:
    return _device("npu")


def is_mlu_available(check_device: bool = False) -> bool:
    return _device("mlu")


def is_musa_available(check_device: bool = False) -> bool:
    return _device("musa")


def is_sdaa_available(check_device: bool = False) -> bool:
    return _device("sdaa")


def is_hpu_available(init_hccl: bool = False) -> bool:
    return _device("hpu")


def is_mps_available(min_version: str = "1.12") -> bool:
    return bool(torch.backends.mps.is_available())


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    return _package("torch_xla")


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 compute is possible: always on CPU, on CUDA when the GPU supports it."""
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True


def is_datasets_available() -> bool:
    return _package("datasets")


def is_transformers_available() -> bool:
    return _package("transformers")


def is_rich_available() -> bool:
    return _package("rich")


def is_schedulefree_available() -> bool:
    return _package("schedulefree")


def is_tensorboard_available() -> bool:
    return _package("tensorboard") or _package("tensorboardX")


def is_wandb_available() -> bool:
    return _package("wandb")


def is_peft_available() -> bool:
    return _package("peft")
def is_fp16_available() -> bool:
    """fp16 compute is possible: on every device fullshard runs on (Accelerate says no only on Gaudi 1)."""
    return True


def is_fp8_available() -> bool:
    """``False``: fullshard refuses ``mixed_precision="fp8"``, whatever FP8 library is installed."""
    return False


def is_torchao_available() -> bool:
    return _package("torchao")


def is_pytest_available() -> bool:
    return _package("pytest")


def is_torchdata_stateful_dataloader_available() -> bool:
    """torchdata's ``StatefulDataLoader`` can be imported (torchdata 0.8 or later)."""
    return _package("torchdata") and _package("torchdata.stateful_dataloader")


def is_pandas_available() -> bool:
    return _package("pandas")


def is_matplotlib_available() -> bool:
    return _package("matplotlib")


def is_comet_ml_available() -> bool:
    return _package("comet_ml")


def is_aim_available() -> bool:
    return _package("aim")


def is_clearml_available() -> bool:
    return _package("clearml")


def is_dvclive_available() -> bool:
    return _package("dvclive")


def is_mlflow_available() -> bool:
    return _package("mlflow")


def is_swanlab_available() -> bool:
    return _package("swanlab")


def is_trackio_available() -> bool:
    return _package("trackio")

"""Accelerate's ``is_*_available`` checks: which devices this process can use and which packages are installed.

Device checks ask torch (``torch.xpu``, ``torch.npu`` exist only in builds or plugins that support them);
package checks look the package up without importing it. Every check is cheap and has no side effect.
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = [
    "is_bf16_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_hpu_available",
    "is_mlu_available",
    "is_mps_available",
    "is_musa_available",
    "is_npu_available",
    "is_peft_available",
    "is_rich_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_tensorboard_available",
    "is_torch_xla_available",
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

"""The names Accelerate's published examples import exist in fullshard at the same module paths, and the
dataloader configuration refuses what it cannot do by name.

The lists are the ``from accelerate import ...`` / ``from accelerate.utils import ...`` names of Accelerate's
``examples/*.py`` and ``examples/by_feature/*.py`` (huggingface/accelerate, read for this test).
"""

from __future__ import annotations

import importlib
import os
import re

import pytest

from fullshard import DataLoaderConfiguration
from fullshard.utils import DummyOptim, patch_environment

EXAMPLE_IMPORTS = {
    "fullshard": ["Accelerator", "DataLoaderConfiguration", "DistributedType", "FullyShardedDataParallelPlugin",
                  "init_empty_weights", "__version__"],
    "fullshard.utils": ["DDPCommunicationHookType", "DistributedDataParallelKwargs", "DummyOptim", "DummyScheduler",
                        "FullyShardedDataParallelPlugin", "MegatronLMDummyScheduler", "PrepareForLaunch",
                        "find_executable_batch_size", "gather_object", "is_npu_available", "is_schedulefree_available",
                        "is_xpu_available", "patch_environment", "set_seed", "tqdm"],
    "fullshard.logging": ["get_logger"],
}  # fmt: skip


@pytest.mark.parametrize("module", sorted(EXAMPLE_IMPORTS))
def test_example_imports_exist(module: str) -> None:
    loaded = importlib.import_module(module)
    missing = [name for name in EXAMPLE_IMPORTS[module] if not hasattr(loaded, name)]
    assert not missing, f"{module} lacks {missing}"


def test_availability_checks_answer_for_this_machine() -> None:
    import torch

    from fullshard.utils import is_cuda_available, is_npu_available, is_transformers_available, is_xpu_available

    cuda_was_initialized = torch.cuda.is_initialized()
    assert isinstance(is_cuda_available(), bool)
    assert torch.cuda.is_initialized() is cuda_was_initialized  # asking does not start CUDA (forked workers stay safe)
    assert is_npu_available() is False and is_xpu_available() == (hasattr(torch, "xpu") and torch.xpu.is_available())
    assert is_transformers_available() is True  # a dependency of the test environment


def test_placeholders_refuse_and_environment_patch_restores() -> None:
    with pytest.raises(RuntimeError, match=re.escape("DummyOptim(...): a placeholder for an object a DeepSpeed")):
        DummyOptim([], lr=1.0)
    os.environ.pop("FULLSHARD_TEST_VAR", None)
    with patch_environment(fullshard_test_var=3):
        assert os.environ["FULLSHARD_TEST_VAR"] == "3"
    assert "FULLSHARD_TEST_VAR" not in os.environ


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"dispatch_batches": True}, ValueError,
         "DataLoaderConfiguration(dispatch_batches=True): fullshard does not dispatch batches from rank 0"),
        ({"use_stateful_dataloader": "yes"}, TypeError,
         "DataLoaderConfiguration(use_stateful_dataloader='yes'): expected True or False."),
        ({"data_seed": 1.5}, TypeError, "DataLoaderConfiguration(data_seed=1.5): expected an int or None."),
    ],
)  # fmt: skip
def test_dataloader_configuration_refuses_by_name(kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        DataLoaderConfiguration(**kwargs)


def test_split_batches_needs_a_divisible_batch() -> None:
    from torch.utils.data import DataLoader

    from fullshard.frontend.data import GradientState, prepare_data_loader

    message = (
        "with split_batches=True: the DataLoader's batch_size (3) must be a multiple of the number of processes (2)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        prepare_data_loader(DataLoader(list(range(8)), batch_size=3), num_processes=2, process_index=0, device=None,
                            gradient_state=GradientState(), split_batches=True)  # fmt: skip

"""The names Accelerate's published examples import exist in fullshard at the same module paths, no public name
is lost, and the dataloader configuration refuses what it cannot do by name.

The lists are the ``from accelerate import ...`` / ``from accelerate.utils import ...`` names of Accelerate's
``examples/*.py`` and ``examples/by_feature/*.py`` (huggingface/accelerate, read for this test).

``public_names.txt`` (beside this file) records every public name of ``fullshard``, ``fullshard.utils``, the
top-level public modules and the Accelerate mirror ``fullshard.accelerate`` with all its submodules: a module's
``__all__`` that it binds, and ``__version__``. A reorganisation that loses one fails here; a name added is
recorded with ``python tests/unit/test_dropin_names.py`` (PYTHONPATH as for pytest), so the surface changes
only in a reviewed diff.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import sys
from pathlib import Path

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


PUBLIC_NAMES = Path(__file__).with_name("public_names.txt")
PUBLIC_MODULES = ["fullshard", "fullshard.utils", "fullshard.wrap", "fullshard.comm_hooks", "fullshard.logging",
                  "fullshard.tracking", "fullshard.accelerate"]  # fmt: skip


def _public_modules() -> list[str]:
    import fullshard.accelerate

    mirror = [m.name for m in pkgutil.walk_packages(fullshard.accelerate.__path__, "fullshard.accelerate.")]
    return sorted({*PUBLIC_MODULES, *mirror})


def _public_names() -> set[str]:
    """``module name`` for every public name of the public modules, as written in ``public_names.txt``."""
    found: set[str] = set()
    for module in _public_modules():
        loaded = importlib.import_module(module)
        names = [n for n in getattr(loaded, "__all__", []) if hasattr(loaded, n)]
        names += ["__version__"] if hasattr(loaded, "__version__") else []
        found.update(f"{module} {name}" for name in names)
    return found


def _recorded() -> set[str]:
    return {line for line in PUBLIC_NAMES.read_text().splitlines() if line and not line.startswith("#")}


def test_no_public_name_is_lost() -> None:
    lost = sorted(_recorded() - _public_names())
    assert not lost, f"public names lost (module name): {lost}; re-export them where they were"


def test_new_public_names_are_recorded() -> None:
    new = sorted(_public_names() - _recorded())
    assert not new, f"new public names {new}: record them with python tests/unit/test_dropin_names.py"


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
        ({"dispatch_batches": 1}, TypeError, "DataLoaderConfiguration(dispatch_batches=1): expected a bool or None."),
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

    from fullshard.frontend.data.sharded_loader import GradientState, prepare_data_loader

    message = (
        "with split_batches=True: the DataLoader's batch_size (3) must be a multiple of the number of processes (2)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        prepare_data_loader(DataLoader(list(range(8)), batch_size=3), num_processes=2, process_index=0, device=None,
                            gradient_state=GradientState(), split_batches=True)  # fmt: skip


if __name__ == "__main__":  # record the public names: python tests/unit/test_dropin_names.py
    header = "# module name: the public surface (tests/unit/test_dropin_names.py); regenerate with that file\n"
    PUBLIC_NAMES.write_text(header + "".join(f"{line}\n" for line in sorted(_public_names())))
    print(f"{PUBLIC_NAMES}: {len(_public_names())} names", file=sys.stderr)

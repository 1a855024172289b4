"""The lazy surfaces (``fullshard.surface``): ``fullshard``, ``fullshard.engine`` and ``fullshard.checkpoint`` import
a name's module when it is first read, so ``fullshard launch``'s own process imports neither the engine nor DTensor
(a second of CPU per launch), while every name still resolves to what an eager import gave."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_launch_command_imports_no_engine_no_dtensor_no_dcp() -> None:
    loaded = _modules_after("import fullshard.cli.main")
    heavy = {"fullshard.engine.fully_shard", "fullshard.engine.wrapper", "fullshard.frontend.accelerator",
             "torch.distributed.tensor", "torch.distributed.checkpoint", "sympy"}  # fmt: skip
    assert not heavy & loaded, sorted(heavy & loaded)
    assert "fullshard.engine.api" in loaded  # what the launcher needs of the engine: its enums (frontend/env.py)


def test_a_name_shared_with_its_submodule_stays_the_function() -> None:
    # the import system binds fullshard.engine.fully_shard (the module) on the package when wrapper.py imports it
    loaded = _modules_after(
        "import fullshard.engine.wrapper\nfrom fullshard.engine import fully_shard, wrap\n"
        "assert callable(fully_shard) and callable(wrap) and not hasattr(fully_shard, '__path__')\n"
        "assert type(fully_shard).__name__ == 'function' == type(wrap).__name__, (fully_shard, wrap)"
    )
    assert "fullshard.engine.fully_shard" in loaded


@pytest.mark.parametrize("package", ["fullshard", "fullshard.engine", "fullshard.checkpoint"])
def test_every_listed_name_resolves_and_is_listed_by_dir(package: str) -> None:
    import importlib

    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'not_a_name'"):
        module.not_a_name  # noqa: B018


def test_preparing_a_model_imports_no_optional_library() -> None:
    # peft, and through it transformers, torchao and scipy, cost ~1.7 s of CPU per rank when ``prepare`` asked
    # whether the model is a PEFT model by importing peft; a model can only be one once peft is imported
    code = (
        "import os, torch\nos.environ['ACCELERATE_USE_FSDP'] = 'true'\nfrom fullshard import Accelerator\n"
        "from fullshard.utils import is_peft_model\naccelerator = Accelerator()\n"
        "model = accelerator.prepare(torch.nn.Linear(2, 2))\n"
        "assert type(model).__name__ == 'FullyShardedDataParallel' and not is_peft_model(model)"
    )
    optional = {"peft", "transformers", "torchao", "scipy", "accelerate"}
    assert not optional & _modules_after(code), sorted(optional & _modules_after(code))
    # and a PEFT model is still seen as one once peft is imported
    pytest.importorskip("peft")
    _modules_after(
        "import torch, peft\nfrom fullshard.utils import is_peft_model\n"
        "base = torch.nn.Sequential(torch.nn.Linear(2, 2))\n"
        "model = peft.get_peft_model(base, peft.LoraConfig(target_modules=['0'], r=1))\n"
        "assert is_peft_model(model) and not is_peft_model(base)"
    )

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

"""``import accelerate`` served by fullshard (``fullshard/cli/as_accelerate.py`` + ``fullshard/accelerate/``).

Each check runs in a fresh interpreter (the test process may hold the real Accelerate): with the redirect
installed, ``accelerate`` and its submodules are fullshard's modules, the ``accelerate`` distribution reports a
version transformers accepts, every name transformers' Trainer, TrainingArguments and modeling_utils import
resolves, names for DeepSpeed or device maps raise by name, and Accelerate's singletons answer as the Trainer
expects. Without the flag a launched script gets whatever ``accelerate`` is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fullshard.cli import as_accelerate

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_", "FULLSHARD_"))}
    base.update(PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1", **(env or {}))
    done = subprocess.run([sys.executable, *args] if args else [sys.executable, "-c", textwrap.dedent(code)],
                          env=base, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_requested_reads_the_variable() -> None:
    assert as_accelerate.requested({"FULLSHARD_AS_ACCELERATE": "1"})
    assert as_accelerate.requested({"FULLSHARD_AS_ACCELERATE": "True"})
    assert not as_accelerate.requested({"FULLSHARD_AS_ACCELERATE": "0"})
    assert not as_accelerate.requested({})


def test_accelerate_modules_and_metadata_are_fullshards() -> None:
    out = _run("""
        import importlib.metadata, pytest
        from fullshard.cli import as_accelerate
        as_accelerate.install()
        import accelerate, accelerate.utils.constants as constants
        import fullshard
        from accelerate.utils import save_fsdp_model, FullyShardedDataParallelPlugin
        assert accelerate.__name__ == "fullshard.accelerate" and accelerate.Accelerator is fullshard.Accelerator
        assert FullyShardedDataParallelPlugin is fullshard.FullyShardedDataParallelPlugin
        assert constants.FSDP_AUTO_WRAP_POLICY[:2] == ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"]
        assert importlib.metadata.version("accelerate") == "1.15.0"
        import os
        assert "ACCELERATE_USE_FSDP" not in os.environ  # one process: Accelerate's DistributedType.NO
        with pytest.raises(ModuleNotFoundError, match="fullshard's mirror, which has no fullshard.accelerate.commands"):
            import accelerate.commands.launch
        with pytest.raises(NotImplementedError, match="accelerate's DeepSpeedPlugin is not provided by fullshard"):
            accelerate.DeepSpeedPlugin()
        with pytest.raises(NotImplementedError, match="accelerate's dispatch_model is not provided by fullshard"):
            accelerate.dispatch_model(None)
        # transformers finds it and takes every name its Trainer, TrainingArguments and modeling_utils import
        from transformers.utils import is_accelerate_available
        assert is_accelerate_available("1.12.0")
        import transformers.trainer as trainer, transformers.training_args as training_args
        import transformers.modeling_utils
        assert trainer.Accelerator is fullshard.Accelerator and trainer.save_fsdp_model is save_fsdp_model
        assert training_args.PartialState.__module__ == "fullshard.frontend.processes.shared_state"
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_singletons_answer_as_the_trainer_expects() -> None:
    out = _run("""
        from fullshard.cli import as_accelerate
        as_accelerate.install()
        from accelerate import Accelerator, FullyShardedDataParallelPlugin
        from accelerate.state import AcceleratorState, PartialState
        from accelerate.utils import DistributedType
        state = PartialState(cpu=True, backend=None)
        assert PartialState().device.type == "cpu" and PartialState().num_processes == 1
        assert state.distributed_type == DistributedType.NO and PartialState._shared_state
        assert AcceleratorState().fsdp_plugin is None
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        accelerator = Accelerator(fsdp_plugin=plugin, deepspeed_plugin=None, parallelism_config=None)
        assert AcceleratorState().fsdp_plugin is plugin and AcceleratorState().is_fsdp2
        assert AcceleratorState().distributed_type == DistributedType.FSDP and accelerator.is_fsdp2
        assert AcceleratorState().num_processes == 1 and AcceleratorState().deepspeed_plugin is None
        accelerator.gradient_state._set_sync_gradients(False)
        assert not accelerator.sync_gradients and accelerator.gradient_state.plugin_kwargs["sync_each_batch"] is False
        AcceleratorState._reset_state(reset_partial_state=True)
        assert PartialState._shared_state == {} and AcceleratorState._shared_state == {}
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_the_flag_leaves_a_normal_launch_untouched(tmp_path: Path) -> None:
    script = tmp_path / "which.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        from fullshard.cli import as_accelerate
        try:
            import accelerate
            name = accelerate.__name__
        except ImportError:
            name = "none"
        print("accelerate:", name, "redirect:", as_accelerate.installed())
    """)
    )
    launch = ["-m", "fullshard.cli.main", "launch", "--num_processes", "1"]
    plain = _run("", *launch, str(script))
    served = _run("", *launch, "--as_accelerate", str(script))
    assert "accelerate: fullshard.accelerate redirect: True" in served
    assert "redirect: False" in plain and "fullshard.accelerate" not in plain
    try:
        import accelerate
    except ImportError:
        assert "accelerate: none" in plain
    else:
        assert f"accelerate: {accelerate.__name__} redirect: False" in plain


def test_torchrun_entry_point(tmp_path: Path) -> None:
    entry = ["-m", "fullshard.cli.worker"]
    script = tmp_path / "which.py"
    script.write_text("import accelerate\nprint('accelerate:', accelerate.__name__)\n")
    out = _run("", *entry, str(script), env={"FULLSHARD_AS_ACCELERATE": "1"})
    assert "accelerate: fullshard.accelerate" in out


def test_peft_trl_and_the_trainer_import_under_the_mirror(tmp_path: Path) -> None:
    # peft imports accelerate.hooks.remove_hook_from_submodules, TRL accelerate.utils.is_peft_model and
    # accelerate.utils.fsdp_utils.get_parameters_from_modules at module level: every script stopped at import
    script = tmp_path / "imports.py"
    script.write_text(
        textwrap.dedent("""
        import peft, trl, transformers
        from transformers import Trainer, TrainingArguments
        from trl import SFTConfig, SFTTrainer
        import trl.models.utils, trl.trainer.dpo_trainer, trl.trainer.callbacks, peft.mixed_model
        import accelerate.utils.versions
        from accelerate.hooks import remove_hook_from_submodules
        from accelerate.utils import is_peft_model
        import fullshard, torch
        model = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), peft.LoraConfig(target_modules=["0"]))
        assert is_peft_model(model) and not is_peft_model(torch.nn.Linear(2, 2))
        assert remove_hook_from_submodules is fullshard.accelerate.hooks.remove_hook_from_submodules
        print("imports ok", accelerate.__name__ if (accelerate := __import__("accelerate")) else "")
    """)
    )
    out = _run("", "-m", "fullshard.cli.main", "launch", "--num_processes", "1", "--as_accelerate", str(script))
    assert "imports ok fullshard.accelerate" in out


def test_install_says_fsdp_only_for_several_processes() -> None:
    code = """
        import os
        from fullshard.cli import as_accelerate
        as_accelerate.install()
        print(os.environ.get("ACCELERATE_USE_FSDP"))
    """
    assert _run(code, env={"WORLD_SIZE": "2"}).strip() == "true"  # transformers' RAM-efficient loading reads it
    assert _run(code, env={"WORLD_SIZE": "1"}).strip() == "None"

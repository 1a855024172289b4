"""Seed 002's utilities: the names exist where Accelerate has them, and each behaves as Accelerate's does on the
same input (enums, nested-data helpers, version checks, kwargs handlers, write_basic_config)."""

from __future__ import annotations

import collections
import importlib
import re
from pathlib import Path

import pytest
import torch
from accelerate import utils as acc

import fullshard.utils as fu
from fullshard.cli.config_file import load_config

SEED_002 = {
    "fullshard": ["DistributedDataParallelKwargs", "GradScalerKwargs", "FullyShardedDataParallelPlugin",
                  "infer_auto_device_map", "load_checkpoint_in_model", "ProfileKwargs", "synchronize_rng_states"],
    "fullshard.utils": [
        "MODEL_NAME", "OPTIMIZER_NAME", "RNG_STATE_NAME", "SCALER_NAME", "SCHEDULER_NAME", "WEIGHTS_NAME",
        "SAFE_WEIGHTS_NAME", "WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_INDEX_NAME", "ComputeEnvironment", "DistributedType",
        "DynamoBackend", "LoggerType", "PrecisionType", "RNGType", "SageMakerDistributedType",
        "DistributedDataParallelKwargs", "GradScalerKwargs", "GradientAccumulationPlugin",
        "FullyShardedDataParallelPlugin", "broadcast", "broadcast_object_list", "concatenate", "convert_to_fp32",
        "gather", "gather_object", "listify", "pad_across_processes", "recursively_apply", "reduce",
        "send_to_device", "slice_tensors", "is_torch_version", "is_bf16_available", "is_npu_available",
        "is_torch_xla_available", "patch_environment", "write_basic_config", "find_executable_batch_size",
        "compute_module_sizes", "extract_model_from_parallel", "get_balanced_memory", "get_max_layer_size",
        "infer_auto_device_map", "load_checkpoint_in_model", "load_offloaded_weights", "load_state_dict",
        "offload_state_dict", "retie_parameters", "set_module_tensor_to_device", "shard_checkpoint", "save",
        "wait_for_everyone", "set_seed", "synchronize_rng_state", "synchronize_rng_states", "merge_fsdp_weights",
        "find_tied_parameters", "check_tied_parameters_on_same_device", "PrepareForLaunch", "get_pretty_name",
        "release_memory", "ProfileKwargs",
    ],
    "fullshard.tracking": ["GeneralTracker", "on_main_process"],
}  # fmt: skip


@pytest.mark.parametrize("module", sorted(SEED_002))
def test_seed_002_names_exist(module: str) -> None:
    loaded = importlib.import_module(module)
    assert [n for n in SEED_002[module] if not hasattr(loaded, n)] == []


@pytest.mark.parametrize("name", ["ComputeEnvironment", "DynamoBackend", "RNGType", "SageMakerDistributedType",
                                  "LoggerType"])  # fmt: skip
def test_enums_have_accelerates_values(name: str) -> None:
    ours, theirs = getattr(fu, name), getattr(acc, name)
    assert {m.name: m.value for m in theirs}.items() <= {m.name: m.value for m in ours}.items()
    first = next(iter(theirs))
    assert str(ours(first.value)) == str(first)  # "NO" vs "SageMakerDistributedType.NO", as Accelerate prints it


def test_nested_helpers_match_accelerate() -> None:
    point = collections.namedtuple("Point", "x y")
    data = {"a": [torch.ones(2, dtype=torch.float16), point(torch.arange(3), torch.zeros(1, dtype=torch.bfloat16))],
            "b": ("text", torch.tensor(2.5, dtype=torch.bfloat16))}  # fmt: skip
    ours, theirs = fu.convert_to_fp32(data), acc.convert_to_fp32(data)
    assert isinstance(ours["a"][1], point) and ours["a"][0].dtype == torch.float32
    assert fu.listify(ours) == acc.listify(theirs) == {"a": [[1.0, 1.0], point([0, 1, 2], [0.0])], "b": ("text", 2.5)}
    assert fu.listify(data) == acc.listify(data)
    sliced = fu.slice_tensors(data["a"], slice(0, 1))
    assert fu.listify(sliced) == acc.listify(acc.slice_tensors(data["a"], slice(0, 1)))


def test_versions_and_pretty_names_match_accelerate() -> None:
    version = torch.__version__.split("+")[0]
    for op in (">", ">=", "==", "!=", "<=", "<"):
        for other in (version, "2.4", "99.0"):
            assert fu.is_torch_version(op, other) == acc.is_torch_version(op, other), (op, other)
    assert fu.compare_versions("torch", ">=", "2.0") and fu.compare_versions("1.2.3", "<", "1.10")
    with pytest.raises(ValueError, match=re.escape("compare_versions(operation='=>'): expected one of")):
        fu.is_torch_version("=>", "2.0")

    class Thing:
        def method(self) -> None: ...

    for obj in (Thing, Thing(), Thing.method, torch.nn.Linear, 3):
        assert fu.get_pretty_name(obj) == acc.get_pretty_name(obj)


def test_kwargs_handlers_report_what_was_set() -> None:
    assert (
        fu.GradScalerKwargs(init_scale=1024, growth_interval=5).to_kwargs()
        == acc.GradScalerKwargs(init_scale=1024, growth_interval=5).to_kwargs()
    )
    ours = fu.GradientAccumulationPlugin(num_steps=3, sync_with_dataloader=False)
    theirs = acc.GradientAccumulationPlugin(num_steps=3, sync_with_dataloader=False)
    assert ours.to_kwargs() == theirs.to_kwargs()
    assert fu.ProfileKwargs(record_shapes=True).to_kwargs() == {"record_shapes": True}
    with pytest.raises(ValueError, match=re.escape("ProfileKwargs(activities=[..., 'tpu', ...]): not an activity")):
        fu.ProfileKwargs(activities=["tpu"]).build()


def test_accelerator_refuses_bad_handlers() -> None:
    from fullshard import Accelerator

    message = "Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=...): pass one of them"
    with pytest.raises(ValueError, match=re.escape(message)):
        Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=fu.GradientAccumulationPlugin(4))
    with pytest.raises(ValueError, match=re.escape("GradientAccumulationPlugin(num_steps=None): expected an int")):
        Accelerator(gradient_accumulation_plugin=fu.GradientAccumulationPlugin())
    with pytest.raises(ValueError, match=re.escape("two GradScalerKwargs objects were given")):
        Accelerator(kwargs_handlers=[fu.GradScalerKwargs(), fu.GradScalerKwargs(init_scale=2.0)])
    with pytest.raises(ValueError, match=re.escape("GradScalerKwargs(backoff_factor=2.0): init_scale and")):
        Accelerator(mixed_precision="fp16", cpu=True, kwargs_handlers=[fu.GradScalerKwargs(backoff_factor=2.0)])


def test_write_basic_config_writes_what_launch_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cfg" / "default_config.yaml"
    assert fu.write_basic_config(mixed_precision="BF16", save_location=path) == path
    config, source = load_config(path)
    assert source == path and config.mixed_precision == "bf16" and config.to_dict()["distributed_type"] == "FSDP"
    before = path.read_text()
    assert fu.write_basic_config(mixed_precision="no", save_location=path) is False  # an existing file is kept
    assert path.read_text() == before and "already exists" in capsys.readouterr().out
    with pytest.raises(ValueError, match=re.escape("write_basic_config(mixed_precision='fp32'): expected one of")):
        fu.write_basic_config(mixed_precision="fp32", save_location=tmp_path / "other.yaml")


def test_synchronize_rng_state_refuses_unknown_kinds() -> None:
    with pytest.raises(ValueError, match=re.escape("synchronize_rng_state(rng_type='xla'): expected one of")):
        fu.synchronize_rng_state("xla")
    fu.synchronize_rng_state(fu.RNGType.TORCH)  # no process group: nothing to agree with, and no error


_ACCUMULATION = """
import json, sys, torch
lib = __import__(sys.argv[1])
from importlib import import_module
GradientAccumulationPlugin = import_module(sys.argv[1] + ".utils").GradientAccumulationPlugin
out = {}
for sync_with_dataloader in (True, False):
    for adjust in (True, False):
        plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=sync_with_dataloader,
                                            adjust_scheduler=adjust)
        accelerator = lib.Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
        loader = torch.utils.data.DataLoader(torch.arange(6.0).reshape(3, 2), batch_size=1)
        model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
        seen = []
        for epoch in range(2):
            for x in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(model(x).sum())
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                seen.append([accelerator.sync_gradients, scheduler.get_last_lr()[0]])
        out[f"{sync_with_dataloader}-{adjust}"] = seen
print(json.dumps(out))
"""


def test_gradient_accumulation_plugin_steps_like_accelerate() -> None:
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    runs = {}
    for lib in ("accelerate", "fullshard"):
        done = subprocess.run([sys.executable, "-c", _ACCUMULATION, lib], env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        runs[lib] = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["fullshard"] == runs["accelerate"]
    syncs = {k: [s for s, _ in v] for k, v in runs["fullshard"].items()}
    assert syncs["True-True"] == [False, True, True] * 2  # the loader's end completes a step
    assert syncs["False-True"] == [False, True] * 3  # the count runs on across epochs

"""transformers' ``Trainer`` with FSDP, unedited, under ``fullshard launch --as_accelerate`` (2 gloo ranks).

Set up: ``scripts/trainer_tiny.py``, a Trainer run of a tiny model built from a config (GPT-2, Llama, BERT),
``TrainingArguments(use_cpu=True, fsdp=..., fsdp_config=...)``: FSDP1 in the string form, FSDP2 with
``fsdp=True``; the same script without FSDP under ``torchrun`` with the real Accelerate (DDP on gloo).
Run: each, 6 steps: FSDP2 with an ``evaluate()`` before training; FSDP1; FSDP2 with the other settings at once
(``from_pretrained`` of the same model saved, ``cpu_ram_efficient_loading`` with rank 1's model on meta,
``activation_checkpointing``, size-based wrapping by ``min_num_params``); runs saving SHARDED_STATE_DICT (FSDP2,
6 steps, every 3) or FULL_STATE_DICT (FSDP1, size-based wrapping, 20 steps of 8 a shuffled epoch, every 9)
checkpoints, and runs resumed from their step-3 (epoch 0) and step-18 (epoch 2, 2 steps in) checkpoints; a run
ending in ``trainer.save_model()``.
Check: the model is sharded (each rank holds half the elements, after the early ``evaluate()`` too), the
per-step losses, evaluation loss and final weights equal Accelerate's DDP run to the last bit; what each setting
did (rank 1 started on meta, the blocks ran forward again in backward, the units size-based wrapping made); the
resumed runs equal the uninterrupted ones (``torch.equal`` weights; after two epochs skipped, the rows the
uninterrupted run fetched, in its order: the Trainer's ``set_epoch`` gives the seedable sampler's order); the
checkpoints are fullshard's (completion markers, or the full files); ``from_pretrained`` loads the saved model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "trainer_tiny.py"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_", "FULLSHARD_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_fullshard(out: Path, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "fullshard.cli.main", "launch", "--num_processes", "2", "--as_accelerate",
               str(SCRIPT), "--output_dir", str(out), *args]  # fmt: skip
    return subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start_accelerate(out: Path, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), str(SCRIPT), "--output_dir", str(out), "--fsdp", "none", *args]  # fmt: skip
    env = _env(ACCELERATE_USE_CPU="true")
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def result(process: subprocess.Popen[str], out: Path) -> dict:
    log, _ = process.communicate(timeout=600)
    assert process.returncode == 0, log
    return json.loads((out / "result.json").read_text())


def _has_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def check_sharded(run: dict) -> None:
    assert run["accelerator"] == "fullshard.frontend.accelerator"
    assert run["local_numel"] < 0.6 * run["full_numel"], "each of 2 ranks must hold about half of the parameters"


def save_tiny_pretrained(kind: str, folder: Path) -> str:
    """The script's model of ``kind``, saved with ``save_pretrained`` (the weights a run built from config has)."""
    spec = importlib.util.spec_from_file_location("trainer_tiny", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.build(kind).save_pretrained(folder)
    return str(folder)


# Size-based wrapping of the tiny GPT-2 with min_num_params=4000, by FSDP1's rule (a module becomes a unit when
# the parameters not already in units below it reach the minimum): per block, the attention (4,224) and the two
# MLP projections (4,224 and 4,128); the MLP itself (none left), the block (128 left: its norms) stay in the root.
SIZE_BASED_UNITS = [f"transformer.h.{i}.{m}" for i in (0, 1) for m in ("attn", "mlp.c_fc", "mlp.c_proj")]
SETTINGS = ["--cpu_ram_efficient_loading", "--others_on_meta", "--activation_checkpointing", "--min_num_params", "4000"]


def test_fsdp1_and_fsdp2_losses_equal_accelerate_ddp_to_the_bit(tmp_path: Path) -> None:
    # - Set up: the GPT-2 every run builds, saved for the run that loads it with from_pretrained
    pretrained = save_tiny_pretrained("gpt2", tmp_path / "pretrained")
    # - Run: FSDP2 (fsdp=True) evaluating first, FSDP1 (the string form), FSDP2 with the other settings, and
    #   Accelerate's DDP, side by side
    runs = {
        "v2": start_fullshard(tmp_path / "v2", "--fsdp", "v2", "--eval_first"),
        "v1": start_fullshard(tmp_path / "v1", "--fsdp", "v1"),
        "settings": start_fullshard(tmp_path / "settings", "--fsdp", "v2", "--from_pretrained", pretrained, *SETTINGS),
    }
    if _has_accelerate():
        runs["ddp"] = start_accelerate(tmp_path / "ddp")
    results = {name: result(process, tmp_path / name) for name, process in runs.items()}
    # - Check
    for name in ("v1", "v2", "settings"):
        check_sharded(results[name])
        assert len(results[name]["losses"]) == 6
        assert results[name]["predictions_shape"] == [10, 16, 64], "predict() gathers every rank's rows"
    assert results["v2"]["model_class"] == "FSDPGPT2LMHeadModel"
    assert results["v2"]["local_numel_after_eval"] < 0.6 * results["v2"]["full_numel"], "evaluate() resharded"
    assert results["v1"]["losses"] == results["v2"]["losses"] == results["settings"]["losses"]
    assert results["settings"]["weights"] == results["v2"]["weights"]
    check_settings(results["settings"])
    if "ddp" not in results:
        pytest.skip("accelerate is not installed: no DDP run to compare with")
    ddp = results["ddp"]
    assert ddp["accelerator"] == "accelerate.accelerator"
    for name in ("v1", "v2", "settings"):
        assert results[name]["losses"] == ddp["losses"], name
        assert results[name]["eval_loss"] == ddp["eval_loss"], name
        assert results[name]["weights"] == ddp["weights"], name


def check_settings(run: dict) -> None:
    """What cpu_ram_efficient_loading, activation_checkpointing and min_num_params did in the settings run."""
    # transformers 5 reads the weights on every rank; the script then put rank 1's model on meta, so every value
    # came from rank 0 (the equal losses and weights show it)
    assert run["on_meta"] == [{"from_pretrained": False, "trainer": False}, {"from_pretrained": False, "trainer": True}]
    assert run["units"] == ["", *SIZE_BASED_UNITS]
    forwards = run["grad_forwards"]
    for i in (0, 1):
        # the attention unit is recomputed in backward: its first projection runs forward twice a step
        assert forwards[f"transformer.h.{i}.attn.c_attn"] == 12
        assert forwards[f"transformer.h.{i}.ln_1"] == 6, "outside the recomputed blocks: once a step"


def test_resume_from_sharded_and_full_checkpoints_equals_uninterrupted_run(tmp_path: Path) -> None:
    # - Set up: the uninterrupted runs: SHARDED_STATE_DICT under FSDP2, a checkpoint every 3 of 6 steps;
    #   FULL_STATE_DICT under FSDP1 with size-based wrapping, every 9 of 20 steps (64 shuffled rows, 8 steps an epoch)
    kinds = {
        "sharded": ["--model", "llama", "--fsdp", "v2", "--state_dict_type", "SHARDED_STATE_DICT", "--save_steps", "3"],
        "full": ["--fsdp", "v1", "--state_dict_type", "FULL_STATE_DICT", "--min_num_params", "4000",
                 "--max_steps", "20", "--save_steps", "9"],
    }  # fmt: skip
    resume_at = {"sharded": "checkpoint-3", "full": "checkpoint-18"}  # epoch 0; epoch 2, 2 steps in
    runs = {kind: start_fullshard(tmp_path / kind, *args) for kind, args in kinds.items()}
    straight = {kind: result(process, tmp_path / kind) for kind, process in runs.items()}
    sharded, full = tmp_path / "sharded" / "checkpoint-3", tmp_path / "full" / "checkpoint-18"
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert (sharded / folder / ".fullshard_complete.json").is_file(), f"{folder} is not fullshard's"
    for file in ("pytorch_model_fsdp.bin", "optimizer.bin"):
        assert (full / file).is_file(), f"FULL_STATE_DICT writes {file}"
    # - Run: fresh output folders holding only the checkpoint, resume_from_checkpoint=True
    runs = {}
    for kind, args in kinds.items():
        (tmp_path / f"resumed_{kind}").mkdir()
        shutil.copytree(tmp_path / kind / resume_at[kind], tmp_path / f"resumed_{kind}" / resume_at[kind])
        runs[kind] = start_fullshard(tmp_path / f"resumed_{kind}", *args, "--resume")
    resumed = {kind: result(process, tmp_path / f"resumed_{kind}") for kind, process in runs.items()}
    # - Check
    for kind in kinds:
        check_sharded(straight[kind])
        assert resumed[kind]["losses"] == straight[kind]["losses"], kind
        assert resumed[kind]["eval_loss"] == straight[kind]["eval_loss"], kind
        weights = {run: torch.load(tmp_path / f"{run}" / "weights.pt") for run in (kind, f"resumed_{kind}")}
        assert all(torch.equal(weights[kind][k], weights[f"resumed_{kind}"][k]) for k in weights[kind]), kind
    # After two epochs skipped, each rank fetched the rows the uninterrupted run fetched from step 19 on, in its
    # order: steps 19 and 20, 4 rows each, and the batch the loader fetches ahead. Epoch 2's order is not epoch 0's
    # (which a generator fresh at prepare would deal: the Trainer with use_seedable_sampler=False, as in Accelerate).
    rows = [fetched[-12:] for fetched in straight["full"]["fetched"]]
    assert resumed["full"]["fetched"] == rows
    assert rows != [fetched[8:20] for fetched in straight["full"]["fetched"]]
    # FSDP1 names its units by the wrappers' paths
    assert straight["full"]["units"] == ["", *(f"_fsdp_wrapped_module.{name}" for name in SIZE_BASED_UNITS)]


def test_save_model_loads_with_from_pretrained(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import BertForSequenceClassification

    out = tmp_path / "bert"
    run = result(start_fullshard(out, "--model", "bert", "--fsdp", "v1", "--save_model"), out)
    check_sharded(run)
    assert run["predictions_shape"] == [10, 2]
    final = out / "final"
    assert (final / "model.safetensors").is_file() and (final / "config.json").is_file()
    model = BertForSequenceClassification.from_pretrained(final)
    saved = load_file(final / "model.safetensors")
    assert set(saved) <= set(run["weights"])
    for name, tensor in model.state_dict().items():
        if name in saved:
            assert float(tensor.double().sum()) == run["weights"][name], name

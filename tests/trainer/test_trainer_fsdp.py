"""transformers' ``Trainer`` with FSDP, unedited, under ``fullshard launch --as_accelerate`` (2 gloo ranks).

Set up: ``scripts/trainer_tiny.py``, a Trainer run of a tiny model built from a config (GPT-2, Llama, BERT),
``TrainingArguments(use_cpu=True, fsdp=..., fsdp_config=...)``: FSDP1 in the string form, FSDP2 with
``fsdp=True``; the same script without FSDP under ``torchrun`` with the real Accelerate (DDP on gloo).
Run: each, 6 steps; a run saving SHARDED_STATE_DICT checkpoints every 3 steps, and a run resumed from its
step-3 checkpoint; a run ending in ``trainer.save_model()``.
Check: the model is sharded (each rank holds half the elements), the per-step losses, evaluation loss and
final weights equal Accelerate's DDP run to the last bit; the resumed run equals the uninterrupted one; the
checkpoint's sharded folders are fullshard's (completion markers); ``from_pretrained`` loads the saved model.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_fsdp1_and_fsdp2_losses_equal_accelerate_ddp_to_the_bit(tmp_path: Path) -> None:
    # - Run: FSDP2 (fsdp=True), FSDP1 (the string form) and Accelerate's DDP, side by side
    runs = {name: start_fullshard(tmp_path / name, "--fsdp", name) for name in ("v2", "v1")}
    if _has_accelerate():
        runs["ddp"] = start_accelerate(tmp_path / "ddp")
    results = {name: result(process, tmp_path / name) for name, process in runs.items()}
    # - Check
    for name in ("v1", "v2"):
        check_sharded(results[name])
        assert len(results[name]["losses"]) == 6
        assert results[name]["predictions_shape"] == [10, 16, 64], "predict() gathers every rank's rows"
    assert results["v2"]["model_class"] == "FSDPGPT2LMHeadModel"
    assert results["v1"]["losses"] == results["v2"]["losses"]
    if "ddp" not in results:
        pytest.skip("accelerate is not installed: no DDP run to compare with")
    ddp = results["ddp"]
    assert ddp["accelerator"] == "accelerate.accelerator"
    for name in ("v1", "v2"):
        assert results[name]["losses"] == ddp["losses"], name
        assert results[name]["eval_loss"] == ddp["eval_loss"], name
        assert results[name]["weights"] == ddp["weights"], name


def test_resume_from_sharded_checkpoint_equals_uninterrupted_run(tmp_path: Path) -> None:
    # - Set up: the uninterrupted run, saving a SHARDED_STATE_DICT checkpoint every 3 steps
    args = ["--model", "llama", "--fsdp", "v2", "--save_steps", "3", "--state_dict_type", "SHARDED_STATE_DICT"]
    straight = result(start_fullshard(tmp_path / "straight", *args), tmp_path / "straight")
    checkpoint = tmp_path / "straight" / "checkpoint-3"
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert (checkpoint / folder / ".fullshard_complete.json").is_file(), f"{folder} is not fullshard's"
    # - Run: a fresh output folder holding only checkpoint-3, resume_from_checkpoint=True
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(checkpoint, resumed_dir / "checkpoint-3")
    resumed = result(start_fullshard(resumed_dir, *args, "--resume"), resumed_dir)
    # - Check
    check_sharded(straight)
    assert resumed["losses"] == straight["losses"]
    assert resumed["weights"] == straight["weights"]
    assert resumed["eval_loss"] == straight["eval_loss"]


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

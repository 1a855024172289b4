"""LoRA through PEFT with transformers' ``Trainer`` and TRL's ``SFTTrainer``, unedited, under ``fullshard launch
--as_accelerate`` (2 gloo ranks).

Set up: ``scripts/trainer_peft.py``: a tiny Llama from a config, LoRA on ``q_proj``/``v_proj``, random rows.
Run: the Trainer with FSDP2 and SHARDED_STATE_DICT checkpoints, and with FSDP1 and FULL_STATE_DICT checkpoints
and ``save_model`` at the end, 4 steps, a checkpoint every 2; each resumed from its step-2 checkpoint; TRL's
``SFTTrainer`` (``peft_config=``) under FSDP2, 3 steps. Every launch before this fix stopped at ``import peft``.
Check: only the adapters train; the checkpoints hold the adapter only (``adapter_only``); the resumed runs give the
uninterrupted runs' last losses and adapters; ``save_model`` writes an adapter that ``PeftModel.from_pretrained``
loads into a fresh base with the trained model's logits.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer.test_trainer_fsdp import _env

pytest.importorskip("peft")
pytest.importorskip("trl")

SCRIPT = Path(__file__).parent / "scripts" / "trainer_peft.py"


def _start(out: Path, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "fullshard.cli.main", "launch", "--num_processes", "2", "--as_accelerate",
               str(SCRIPT), "--output_dir", str(out), *args]  # fmt: skip
    return subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen[str], out: Path) -> dict:
    log, _ = process.communicate(timeout=600)
    assert process.returncode == 0, log
    return json.loads((out / "result.json").read_text())


def _resume(straight: Path, resumed: Path, *args: str) -> subprocess.Popen[str]:
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    return _start(resumed, "--resume", *args)


def test_trainer_and_sft_trainer_train_save_and_resume_lora(tmp_path: Path) -> None:
    # - Run: the three uninterrupted runs side by side, then the two resumed ones
    runs = {
        "v2": ("--fsdp", "2", "--state_dict_type", "SHARDED_STATE_DICT", "--save_steps", "2"),
        "v1": ("--fsdp", "1", "--state_dict_type", "FULL_STATE_DICT", "--save_steps", "2", "--save_model"),
        "trl": ("--fsdp", "2", "--trl", "--max_steps", "3"),
    }
    started = {name: _start(tmp_path / name, *args) for name, args in runs.items()}
    results = {name: _finish(process, tmp_path / name) for name, process in started.items()}
    started = {f"{n}_resumed": _resume(tmp_path / n, tmp_path / f"{n}_resumed", *runs[n][:4]) for n in ("v1", "v2")}
    results.update({name: _finish(process, tmp_path / name) for name, process in started.items()})
    # - Check: the runs ended, training the adapters only
    for name, result in results.items():
        assert result["accelerator"] == "fullshard.frontend.accelerator", name
        assert result["peft_model"].endswith("PeftModelForCausalLM"), name
        assert len(result["trainable"]) == 8 and all("lora_" in n for n in result["trainable"]), name
        assert len(result["losses"]) == (3 if name == "trl" else 4), name  # a resumed run: 2 of them restored
        assert all(math.isfinite(loss) for loss in result["losses"].values()), name
    # the checkpoints hold the adapter only, and resuming from them gives the uninterrupted run
    assert all("lora_" in k for k in torch.load(tmp_path / "v1" / "checkpoint-2" / "pytorch_model_fsdp.bin"))
    for name in ("v1", "v2"):
        resumed = results[f"{name}_resumed"]
        assert resumed["losses"] == results[name]["losses"], name
        trained = [torch.load(tmp_path / run / "trained.pt") for run in (name, f"{name}_resumed")]
        assert all(torch.equal(trained[0]["adapters"][k], trained[1]["adapters"][k]) for k in trained[0]["adapters"])
    # save_model wrote the adapter, which loads into a fresh base with the trained model's logits
    from peft import PeftModel
    from safetensors.torch import load_file

    sys.path.insert(0, str(SCRIPT.parent))
    from trainer_peft import base, probe

    final = tmp_path / "v1" / "final"
    assert len(load_file(final / "adapter_model.safetensors")) == 8
    with torch.no_grad():
        logits = PeftModel.from_pretrained(base(), final)(input_ids=probe()).logits
    torch.testing.assert_close(logits, torch.load(tmp_path / "v1" / "trained.pt")["logits"], rtol=1e-5, atol=1e-5)

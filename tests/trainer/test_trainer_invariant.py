"""transformers' ``Trainer`` in world-size-invariant mode, unedited, under ``fullshard launch --as_accelerate
--use_fsdp --fsdp_invariant_micro_batches 4`` on 1, 2 and 4 gloo ranks.

Set up: ``scripts/trainer_invariant.py``, a tiny GPT-2 with dropout on, ``per_device_train_batch_size=2`` (the
micro-batch), ``gradient_accumulation_steps=4 // WORLD_SIZE``, clipping, two shuffled epochs of 28 rows (global
batches of 8: the last one of each epoch padded), labels with a varying number of masked positions.
Run: FSDP2 with the loss normalised by the Trainer's ``num_items_in_batch`` on 1, 2 and 4 ranks; FSDP1 with the
Trainer's own loss scaling (the model takes no loss kwargs) on 1 and 2 ranks; a run with the wrong accumulation
steps and one with ``group_by_length``.
Check: ``torch.equal`` final weights and equal gradient norms at every step across world sizes (``evaluate()``
runs; its loss is not compared: the Trainer's evaluation loss depends on N in any mode); the refusals name the
value to use. In process: which seed ``_set_sync_gradients`` gives a micro-batch, whether the loop
fetches the step's micro-batches ahead (as the Trainer does) or one at a time.
See [Note: the Trainer in invariant mode] in ``src/fullshard/frontend/invariant.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fullshard.frontend.data.sharded_loader import GradientState
from fullshard.frontend.invariant import CallerSteps, InvariantRun

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "trainer_invariant.py"
GPT2_UNITS = ["--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "GPT2Block"]


def start(out: Path, ranks: int, version: int, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_", "FULLSHARD_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    command = [sys.executable, "-m", "fullshard.cli.main", "launch", "--num_processes", str(ranks), "--as_accelerate",
               "--use_fsdp", "--fsdp_version", str(version), *GPT2_UNITS, "--fsdp_invariant_micro_batches", "4",
               str(SCRIPT), "--output_dir", str(out), *args]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen[str]) -> str:
    log, _ = process.communicate(timeout=600)
    return log


def check_equal_runs(tmp_path: Path, runs: dict[int, subprocess.Popen[str]]) -> None:
    for process in runs.values():
        log = finish(process)
        assert process.returncode == 0, log
    results = {n: json.loads((tmp_path / str(n) / "result.json").read_text()) for n in runs}
    weights = {n: torch.load(tmp_path / str(n) / "weights.pt") for n in runs}
    for n in runs:
        assert results[n]["accelerator"] == "fullshard.frontend.accelerator"
        assert results[n]["accumulation"] == 4 // n
        assert results[n]["steps"] == 8, "two epochs of 4 global batches (the last one padded), on any N"
        assert results[n]["grad_norms"] == results[1]["grad_norms"], n
        assert weights[n].keys() == weights[1].keys()
        assert all(torch.equal(weights[n][k], weights[1][k]) for k in weights[1]), f"{n} ranks: other weights"
        # evaluate() runs; its loss is the Trainer's, which depends on N in any mode (each evaluation batch's loss is
        # normalised by the label tokens of all ranks' current batches, times N)
        assert 3.0 < results[n]["eval_loss"] < 4.5


def test_trainer_weights_equal_on_1_2_and_4_ranks_with_num_items_in_batch(tmp_path: Path) -> None:
    # - Run: FSDP2, the Trainer passing num_items_in_batch (the global batch's label tokens) to the model
    runs = {n: start(tmp_path / str(n), n, 2) for n in (1, 2, 4)}
    # - Check
    check_equal_runs(tmp_path, runs)


def test_trainer_weights_equal_on_1_and_2_ranks_with_its_own_loss_scaling(tmp_path: Path) -> None:
    # - Run: FSDP1, the Trainer dividing each micro-batch's mean loss by its accumulation steps
    runs = {n: start(tmp_path / str(n), n, 1, "--no_loss_kwargs") for n in (1, 2)}
    # - Check
    check_equal_runs(tmp_path, runs)


def test_trainer_refusals_name_the_fix(tmp_path: Path) -> None:
    # - Run: one rank, G = 4, with gradient_accumulation_steps=2; and with group_by_length
    wrong_steps = start(tmp_path / "steps", 1, 2, "--accumulation", "2")
    grouped = start(tmp_path / "grouped", 1, 2, "--group_by_length")
    logs = {"steps": finish(wrong_steps), "grouped": finish(grouped)}
    # - Check
    assert wrong_steps.returncode != 0 and grouped.returncode != 0
    assert "G/N = 4 micro-batches per rank and optimizer step, but the training loop steps after 2" in logs["steps"]
    assert "set TrainingArguments(gradient_accumulation_steps=4)" in logs["steps"]
    assert "LengthGroupedSampler" in logs["grouped"] and "train_sampling_strategy='random'" in logs["grouped"]


def seeds_after_announcing(steps: CallerSteps, syncs: list[bool]) -> list[int]:
    """The first draw of torch's global RNG after each announcement (a stand-in for the micro-batch's dropout)."""
    state = GradientState(caller_steps=steps)
    draws = []
    for sync in syncs:
        state._set_sync_gradients(sync)
        draws.append(int(torch.randint(0, 2**31, ())))
    return draws


def test_each_micro_batch_is_seeded_by_its_own_seed_whether_fetched_ahead_or_one_at_a_time() -> None:
    # - Set up: rank 1 of 2 with G = 4 (micro-batches 2 and 3 of each global batch), seeds 100 + index
    def expected(index: int) -> int:
        return int(torch.randint(0, 2**31, (), generator=torch.Generator().manual_seed(100 + index)))

    # - Run: the Trainer's way (fetch both, then announce both), then one at a time (fetch, announce)
    ahead = CallerSteps(InvariantRun(4, 2))
    for index in (2, 3):
        ahead.record(index, 100 + index)
    ahead_draws = seeds_after_announcing(ahead, [False, True])
    one_by_one = CallerSteps(InvariantRun(4, 2))
    draws = []
    for index, sync in ((6, False), (7, True)):
        one_by_one.record(index, 100 + index)
        draws += seeds_after_announcing(one_by_one, [sync])
    # - Check
    assert ahead_draws == [expected(2), expected(3)]
    assert draws == [expected(6), expected(7)]
    assert ahead.count == 0 and one_by_one.count == 0, "a step ends on the announced sync"
    with pytest.raises(ValueError, match=r"steps after more than 2 micro-batches.*gradient_accumulation_steps=2"):
        seeds_after_announcing(ahead, [False, False])

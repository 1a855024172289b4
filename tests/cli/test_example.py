"""``examples/train_gpt.py`` under ``fullshard launch --num_processes 2``: trains, checkpoints, resumes, exports.

Set up: the shipped corpus, 4 steps, a checkpoint every 2 steps.
Run: once straight through; once for 2 steps and then ``--resume`` to 4.
Check: the checkpoint layout of seed 001, a loadable merged ``model.safetensors``, and that the resumed run's
losses are exactly those of the straight run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_gpt.py"


def start(
    output: Path, steps: int, *extra: str, processes: int = 2, options: tuple[str, ...] = ()
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1", FULLSHARD_HOME=str(output / "home"))
    args = ["--num_processes", str(processes), *options, str(SCRIPT), "--steps", str(steps), "--save_every", "2",
            "--output", str(output)]  # fmt: skip
    command = [sys.executable, "-m", "fullshard.cli.main", "launch", *args, *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stdout + stderr
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def launch(
    output: Path, steps: int, *extra: str, processes: int = 2, options: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return finish(start(output, steps, *extra, processes=processes, options=options))


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    output = tmp_path_factory.mktemp("straight")
    result = launch(output, 4)
    return output, result.stdout


def test_example_trains_checkpoints_and_merges(straight_run: tuple[Path, str]) -> None:
    from safetensors.torch import load_file

    from fullshard.testing.models import TinyGPT

    output, stdout = straight_run
    losses = json.loads((output / "losses.json").read_text())
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert "4/4" in stdout and "loss" in stdout, "the main process shows a progress bar with the loss"
    logged = [json.loads(line) for line in (output / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in logged] == list(enumerate(losses, start=1))  # the tracker, rank 0 only
    # Saved at steps 2 and 4 under automatic naming: checkpoint_0 and checkpoint_1, both kept (total_limit=2).
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]
    assert sorted(p.name for p in (output / "checkpoints" / "checkpoint_1").iterdir()) == [
        ".fullshard_checkpoint.json",  # the manifest: the checkpoint is complete
        "custom_checkpoint_0.pkl",
        "optimizer_0",
        "pytorch_model_fsdp_0",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "sampler.bin",
        "scheduler.bin",
    ]
    weights = load_file(output / "model.safetensors")
    assert weights.keys() == TinyGPT().state_dict().keys()
    # The last lines say where the checkpoints, the metrics log and the merged weights are.
    assert stdout.splitlines()[-3:] == [
        f"checkpoints: {output / 'checkpoints'} (latest: checkpoint_1)",
        f"metrics log: {output / 'logs' / 'metrics.jsonl'}",
        f"merged weights: {output / 'model.safetensors'}",
    ]


def test_example_resume_reproduces_the_losses(straight_run: tuple[Path, str], tmp_path: Path) -> None:
    straight = json.loads((straight_run[0] / "losses.json").read_text())
    # --resume on a fresh folder starts fresh (so a restart can pass it blindly) ...
    result = launch(tmp_path, 2, "--resume")
    assert "no complete checkpoint" in result.stdout and "starting fresh" in result.stdout
    first = json.loads((tmp_path / "losses.json").read_text())
    # ... and later continues from the latest complete checkpoint.
    result = launch(tmp_path, 4, "--resume")
    second = json.loads((tmp_path / "losses.json").read_text())
    assert "resumed from" in result.stdout and "checkpoint_0 at step 2" in result.stdout
    assert first + second == straight
    # A finished run resumed again has nothing left to train: it says so, exits 0 and keeps its results.
    result = launch(tmp_path, 4, "--resume")
    assert "nothing left to train" in result.stdout and "at step 4" in result.stdout
    assert json.loads((tmp_path / "losses.json").read_text()) == second
    assert f"merged weights: {tmp_path / 'model.safetensors'}" in result.stdout


def test_example_invariant_mode_gives_the_same_weights_on_1_and_2_ranks(tmp_path: Path) -> None:
    """``--invariant_micro_batches 4`` on 1 rank, the launcher's ``--fsdp_invariant_micro_batches 4`` on 2: the
    merged weights after 3 steps are bitwise equal (docs/accelerate.md, "World-size-invariant training")."""
    import torch
    from safetensors.torch import load_file

    runs = [  # side by side: independent folders
        start(tmp_path / "one", 3, "--batch", "2", "--invariant_micro_batches", "4", processes=1),
        start(tmp_path / "two", 3, "--batch", "2", options=("--use_fsdp", "--fsdp_invariant_micro_batches", "4")),
    ]
    try:
        for run in runs:
            finish(run)
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)

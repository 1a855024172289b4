"""Scripts written the way Accelerate's examples are, run unchanged under ``fullshard launch`` with Accelerate's
config files, and (where ``accelerate`` imports) compared with Accelerate's own run of the same script.

Set up: the three scripts of ``scripts/`` (FSDP with peak memory tracking, gradient accumulation, checkpointing;
a toy classifier with dropout, shuffled data, 2 processes), the config files ``accelerate config`` writes for
FSDP and for multi-CPU.
Run: each script under ``fullshard launch --config_file``; the same script with its imports changed to
``accelerate`` under ``torchrun`` on Accelerate's CPU data-parallel path (MULTI_CPU: DDP on gloo); the
checkpointing script resumed from a mid-epoch step (skipping batches, or with the stateful loader) and from
an epoch's end.
Check: they learn; every rank saw the same samples in every epoch as under Accelerate and the per-epoch losses
are Accelerate's (fp32 tolerance: FSDP and DDP reduce in different orders); a resumed run reproduces the
uninterrupted run's later steps.
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

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"
COMMON = """compute_environment: LOCAL_MACHINE
debug: false
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""
CONFIGS = {
    "multi_cpu": COMMON + "distributed_type: MULTI_CPU\n",
    "fsdp": COMMON
    + """distributed_type: FSDP
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: SIZE_BASED_WRAP
  fsdp_min_num_params: 100
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
""",
}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_fullshard(tmp: Path, config: str, script: str, *args: str) -> subprocess.Popen[str]:
    config_file = tmp / f"{config}.yaml"
    config_file.write_text(CONFIGS[config])
    command = [sys.executable, "-m", "fullshard.cli.main", "launch", "--config_file", str(config_file),
               str(SCRIPTS / script), *args]  # fmt: skip
    env = _env(PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", FULLSHARD_HOME=str(tmp / "home"))
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start_accelerate(tmp: Path, script: str, *args: str) -> subprocess.Popen[str]:
    """The same script with only its import lines changed, on Accelerate's MULTI_CPU path (2 processes)."""
    folder = tmp / "accelerate_scripts"
    folder.mkdir(exist_ok=True)
    shutil.copy(SCRIPTS / "toy_data.py", folder)
    text = (SCRIPTS / script).read_text()
    text = text.replace("\nfrom fullshard import ", "\nfrom accelerate import ")
    text = text.replace("\nfrom fullshard.utils import ", "\nfrom accelerate.utils import ")
    assert "fullshard" not in text.split('"""', 2)[2]
    (folder / script).write_text(text)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), str(folder / script), *args]  # fmt: skip
    env = _env(ACCELERATE_USE_CPU="true")
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen[str]) -> str:
    out, _ = process.communicate(timeout=600)
    assert process.returncode == 0, out
    return out


def records(output: Path) -> list[dict]:
    return [json.loads((output / f"rank{r}.json").read_text()) for r in range(2)]


def run_pair(tmp: Path, config: str, script: str, *args: str) -> tuple[list[dict], list[dict] | None]:
    """fullshard's records and, when accelerate imports, Accelerate's (the two runs go side by side)."""
    ours = start_fullshard(tmp, config, script, "--output", str(tmp / "fullshard"), *args)
    theirs = None
    if _has_accelerate():
        theirs = start_accelerate(tmp, script, "--output", str(tmp / "accelerate"), *args)
    finish(ours)
    if theirs is not None:
        try:
            finish(theirs)
        except AssertionError:
            # Accelerate's run is the reference, not what is under test: once, after the script had printed all
            # its epochs, one of its processes aborted at exit in torch ("terminate called without an active
            # exception"). Run it once more, alone, before failing; fullshard's run gets no second chance.
            shutil.rmtree(tmp / "accelerate", ignore_errors=True)
            finish(start_accelerate(tmp, script, "--output", str(tmp / "accelerate"), *args))
    return records(tmp / "fullshard"), records(tmp / "accelerate") if theirs is not None else None


def _has_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def check_same_as_accelerate(ours: list[dict], theirs: list[dict] | None, key: str = "epoch_losses") -> None:
    if theirs is None:
        pytest.skip("accelerate is not installed: the comparison with its run is not possible here")
    for rank in range(2):
        assert ours[rank]["samples"] == theirs[rank]["samples"], f"rank {rank} saw other samples than in Accelerate"
        assert ours[rank][key] == pytest.approx(theirs[rank][key], rel=1e-5, abs=1e-6)


def check_learns(losses: list[float]) -> None:
    assert losses[-1] < 0.6 * losses[0], losses


def check_epochs_partition_the_data(per_rank_samples: list[list[int]], n: int) -> None:
    seen = sorted(i for samples in per_rank_samples for i in samples)
    assert set(seen) == set(range(n)), "an epoch must visit every sample"


# --- FSDP with peak memory tracking (FSDP config), gradient accumulation (multi-CPU config) ----------------


def test_peak_memory_script_runs_learns_and_matches_accelerate(tmp_path: Path) -> None:
    # 2 of the script's 3 epochs: everything below shows by then (every traced epoch costs ~15 s of the suite)
    ours, theirs = run_pair(tmp_path, "fsdp", "peak_memory.py", "--num_epochs", "2")
    assert ours[0]["epoch_losses"] == ours[1]["epoch_losses"]
    check_learns(ours[0]["epoch_losses"])
    assert len(ours[0]["peak_mb"]) == 2 and all(mb > 0 for mb in ours[0]["peak_mb"])
    for epoch in range(2):
        check_epochs_partition_the_data([ours[0]["samples"][epoch], ours[1]["samples"][epoch]], 70)
    assert ours[0]["samples"][0] != ours[0]["samples"][1], "the data is reshuffled every epoch"
    check_same_as_accelerate(ours, theirs)
    assert ours[0]["accuracy"] == pytest.approx(theirs[0]["accuracy"])


def test_gradient_accumulation_script_with_seedable_sampler_matches_accelerate(tmp_path: Path) -> None:
    ours, theirs = run_pair(tmp_path, "multi_cpu", "gradient_accumulation.py", "--use_seedable_sampler")
    check_learns(ours[0]["epoch_losses"])
    assert ours[0]["optimizer_steps"] == 3 * 4  # 10 batches a rank and epoch, a step every 3 and at the end
    check_same_as_accelerate(ours, theirs)
    assert ours[0]["optimizer_steps"] == theirs[0]["optimizer_steps"]


# --- checkpointing: an uninterrupted run, Accelerate's, and resumed runs ---------------------------------


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], list[dict] | None]:
    tmp = tmp_path_factory.mktemp("straight")
    ours, theirs = run_pair(tmp, "fsdp", "checkpointing.py", "--checkpointing_steps", "4")
    return tmp / "fullshard", ours, theirs


def test_checkpointing_script_learns_and_matches_accelerate(straight) -> None:  # type: ignore[no-untyped-def]
    output, ours, theirs = straight
    check_learns(list(ours[0]["epoch_losses"].values()))
    assert sorted(p.name for p in output.glob("step_*")) == ["step_12", "step_16", "step_20", "step_24", "step_4",
                                                             "step_8"]  # fmt: skip
    check_same_as_accelerate(ours, theirs)


@pytest.mark.parametrize(
    "checkpoint, extra",
    [("step_12", []), ("step_12", ["--use_stateful_dataloader"]), ("step_16", [])],
    ids=["mid-epoch-skip_first_batches", "mid-epoch-stateful", "epoch-end"],
)
def test_resumed_run_reproduces_the_uninterrupted_one(straight, tmp_path: Path, checkpoint: str, extra) -> None:  # type: ignore[no-untyped-def]
    output, ours, _ = straight
    resumed_dir = tmp_path / "resumed"
    process = start_fullshard(tmp_path, "fsdp", "checkpointing.py", "--output", str(resumed_dir),
                              "--resume_from_checkpoint", str(output / checkpoint), *extra)  # fmt: skip
    log = finish(process)
    resumed = records(resumed_dir)
    step = int(checkpoint.removeprefix("step_"))
    assert f"step {step}" in log
    for rank in range(2):
        later = {s: v for s, v in ours[rank]["step_losses"].items() if int(s) > step}
        assert resumed[rank]["step_losses"] == pytest.approx(later, rel=1e-6, abs=1e-7)
        for epoch, samples in resumed[rank]["samples"].items():
            assert ours[rank]["samples"][epoch][-len(samples) :] == samples

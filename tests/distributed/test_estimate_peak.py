"""``estimate-memory``'s peak per rank against the peak RSS of a real training run, within 10%.

Set up: a GPT of 21M parameters (4 blocks of width 512, vocabulary 8192) trained for 2 AdamW steps by
FullyShardedDataParallel FULL_SHARD on 2 freshly spawned gloo ranks, ``MALLOC_MMAP_THRESHOLD_=131072`` so
that RSS follows live tensors (``benchmarks/measure_peak.py``, which records ``ru_maxrss``).
Check: the estimate from the meta-device model is within 10% of the larger rank's peak, the issue's target.
Why 10% holds and is not loose: the model part (peak minus the RSS before the model) is over 300 MiB here,
more than the process baseline, and on this machine the estimate measured -4%..+3% for 20-120M-parameter
GPTs on 1, 2 and 4 ranks (docs/benchmarks.md); what varies is allocator slack and the baseline's few MiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from fullshard.engine.api import ShardingStrategy
from fullshard.frontend.estimate import estimate_training
from fullshard.testing.models import Block, GPTConfig, TinyGPT

CFG = GPTConfig(vocab_size=8192, block_size=128, n_layer=4, n_head=8, n_embd=512)


REPO = Path(__file__).resolve().parents[2]


def _measure_in_clean_process(out: Path) -> dict:
    """Run ``benchmarks/measure_peak.py`` in a new interpreter with a minimal environment: inside a long test
    session the ranks spawned from pytest measured 1.8x the peak they measure alone (the same code), so the
    measurement must not inherit what earlier tests left in this process."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "LANG") if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    args = ["--layers", str(CFG.n_layer), "--width", str(CFG.n_embd), "--heads", str(CFG.n_head)]
    args += ["--vocab", str(CFG.vocab_size), "--seq", str(CFG.block_size), "--world", "2"]
    args += ["--strategies", "FULL_SHARD", "--batch", "2", "--steps", "2", "--out", str(out)]
    cmd = [sys.executable, str(REPO / "benchmarks" / "measure_peak.py"), *args]
    subprocess.run(cmd, env=env, cwd=REPO, check=True, timeout=1800, capture_output=True)
    (row,) = json.loads(out.read_text())
    return row


def test_estimate_within_ten_percent_of_measured_peak(tmp_path: Path) -> None:
    row = _measure_in_clean_process(tmp_path / "peak.json")
    with torch.device("meta"):
        model = TinyGPT(CFG)
    estimate = estimate_training(model, {Block}, 2, ShardingStrategy.FULL_SHARD, batch=2, seq=CFG.block_size)
    assert row["peak_bytes"] - row["base_bytes"] > 250 * 2**20, row
    assert abs(estimate.peak / row["peak_bytes"] - 1) <= 0.10, (estimate.peak, row)

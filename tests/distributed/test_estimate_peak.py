"""``estimate-memory``'s peak per rank against the peak RSS of a real training run, within 10%.

Set up: a GPT of 21M parameters (4 blocks of width 512, vocabulary 8192) trained for 2 AdamW steps by
FullyShardedDataParallel FULL_SHARD on 2 ranks spawned from this test process, ``MALLOC_MMAP_THRESHOLD_=131072``
so that RSS follows live tensors (``fullshard.testing.bench.peak_rss_of_training``, which ``benchmarks/train.py
peak`` runs too; it records each rank's ``VmHWM``: its ``ru_maxrss`` would be at least this pytest process's
size, see ``fullshard.testing.memory``).
Check: the estimate from the meta-device model is within 10% of the larger rank's peak, the issue's target.
Why 10% holds and is not loose: the model part (peak minus the RSS before the model) is over 300 MiB here,
more than the process baseline, and on this machine the estimate measured -4%..+3% for 20-120M-parameter
GPTs on 1, 2 and 4 ranks (docs/benchmarks.md); what varies is allocator slack and the baseline's few MiB.
"""

from __future__ import annotations

import pytest
import torch

from fullshard.cli.memory_estimate import estimate_training
from fullshard.engine.api import ShardingStrategy
from fullshard.testing.bench import peak_rss_of_training
from fullshard.testing.models import Block, GPTConfig, TinyGPT

CFG = GPTConfig(vocab_size=8192, block_size=128, n_layer=4, n_head=8, n_embd=512)


def test_estimate_within_ten_percent_of_measured_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")  # inherited by the spawned ranks
    row = peak_rss_of_training(CFG, 2, "FULL_SHARD", batch=2, steps=2, ac=False)
    with torch.device("meta"):
        model = TinyGPT(CFG)
    estimate = estimate_training(model, {Block}, 2, ShardingStrategy.FULL_SHARD, batch=2, seq=CFG.block_size)
    assert row["peak_bytes"] - row["base_bytes"] > 250 * 2**20, row
    assert abs(estimate.peak / row["peak_bytes"] - 1) <= 0.10, (estimate.peak, row)

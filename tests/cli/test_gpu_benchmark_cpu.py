"""``benchmarks/gpu.py --device cpu``: the multi-rank GPU benchmark's smoke run on gloo, and its overlap arithmetic.

The script is meant for N GPUs (one NCCL rank each); here it runs 2 gloo CPU ranks on a tiny GPT with two
systems, so that every path but the CUDA calls runs where there is no GPU: spawning ranks, building the systems
from the kit, the timed and the profiled steps, the per-rank rows combined, the loss check against the baseline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from overlap import hidden_fraction, union  # noqa: E402


def test_hidden_fraction_counts_communication_covered_by_compute() -> None:
    # comm 0-10 and 20-30 (20 us); compute 5-25 covers 5-10 and 20-25
    assert hidden_fraction([(0, 10), (20, 30)], [(5, 25)]) == (0.5, 20)
    # overlapping communication counts once; compute split in pieces counts where it covers
    assert union([(5, 15), (0, 10)]) == [(0, 15)]
    assert hidden_fraction([(0, 10), (5, 15)], [(0, 3), (2, 6), (14, 40)]) == (pytest.approx(7 / 15), 15)
    assert hidden_fraction([(0, 10)], [(10, 20)]) == (0.0, 10)
    assert hidden_fraction([], [(0, 1)]) == (None, 0.0)


def test_gpu_benchmark_runs_on_two_gloo_ranks(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    systems = ["fullshard fully_shard", "torch FSDP2 fully_shard"]
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--size", "tiny", "--steps",
               "1", "--warmup", "1", "--profile_steps", "1", "--systems", *systems, "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ranks"] == 2 and result["device"] == "cpu"
    rows = {row["system"]: row for row in result["rows"]}
    assert list(rows) == systems
    for row in rows.values():
        assert len(row["losses"]) == 2 and row["step_ms"] > 0 and row["peak_gib"] > 0
        # both shard over 2 ranks, so both all-gather and reduce-scatter: the profiler saw it on every rank
        assert row["comm_ms"] > 0 and all(0 <= h <= 1 for h in row["hidden_per_rank"]), row
    # the script checked the losses against torch FSDP2's; the table names both
    assert all(name in done.stdout for name in systems)

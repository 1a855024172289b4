"""``benchmarks/gpu.py`` on two GPUs: one NCCL rank per GPU, every system's row with its overlap of communication.

Runs only where 2 GPUs exist (this project's CI has none; ``tests/cli/test_gpu_benchmark_cpu.py`` runs the same
script on gloo CPU ranks everywhere).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"needs 2 CUDA GPUs (one NCCL rank each); {torch.cuda.device_count()} visible",
)


def test_gpu_benchmark_on_two_gpus(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    systems = ["fullshard fully_shard", "fullshard FSDP FULL_SHARD", "torch FSDP2 fully_shard"]
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--ranks", "2", "--size", "tiny", "--steps", "2",
               "--warmup", "1", "--systems", *systems, "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ranks"] == 2 and result["device"] == "cuda"
    for row in result["rows"]:
        # two ranks: every system all-gathers and reduce-scatters, as NCCL kernels the profiler saw on both
        assert row["comm_ms"] > 0 and all(h is not None and 0 <= h <= 1 for h in row["hidden_per_rank"]), row

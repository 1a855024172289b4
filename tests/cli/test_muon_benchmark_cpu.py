"""``benchmarks/muon.py``'s smoke run: a tiny GPT, 2 gloo ranks, every row (fullshard + AdamW, fullshard + Muon
with whole-parameter steps, pipelined and serial, torch FSDP2 + Muon), 2 steps of 2 accumulated micro-batches and
the peak-memory runs, so that the script the docs quote keeps running: the rows, the phase timers and the JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_muon_benchmark_runs_on_two_gloo_ranks(tmp_path: Path) -> None:
    out = tmp_path / "muon.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / "muon.py"), "--layers", "1", "--width", "32", "--heads",
               "2", "--batch", "2", "--accumulate", "2", "--steps", "2", "--warm", "1", "--peak-steps", "1",
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    adamw, muon, whole, serial, fsdp2 = rows.values()
    assert list(rows) == [
        "fullshard fully_shard + adamw",
        "fullshard fully_shard + muon",
        "fullshard fully_shard + muon-whole",
        "fullshard fully_shard + muon-serial",
        "torch FSDP2 fully_shard + muon",
    ]
    assert adamw["ratio"] == 1.0 and all(r["step_ms"] > 0 and r["peak_ratio"] > 0 for r in rows.values())
    # the phase timers saw fullshard's exchange and Newton-Schulz: pipelined from the second (timed) step on,
    # all gathered then all scattered in the serial row; torch FSDP2 runs Newton-Schulz, no exchange
    assert muon["pipeline_ms"] > 0 and muon["newton-schulz_ms"] > 0 and muon["finish_ms"] == 0  # split: all in it
    assert whole["pipeline_ms"] > 0 and whole["finish_ms"] > 0 and whole["newton-schulz_ms"] > 0
    assert serial["gather all_to_all_ms"] > 0 and serial["scatter all_to_all_ms"] > 0 and serial["pipeline_ms"] == 0
    assert fsdp2["gather_ms"] == 0 and fsdp2["newton-schulz_ms"] > 0 and adamw["newton-schulz_ms"] == 0
    # same weights and batch at the first step; Muon's update differs from AdamW's at the second
    assert adamw["losses"][0] == muon["losses"][0] == fsdp2["losses"][0]
    assert muon["losses"][1] != adamw["losses"][1]
    # the pipelined exchange (from the second step) and the serial one step to the same weights
    assert serial["losses"] == muon["losses"] == whole["losses"]

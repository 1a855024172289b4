"""``benchmarks/simulate.py --quick``: fullshard under torch's fake process group, against the formulas.

Set up: a tiny GPT (three blocks + root, every dim odd) on the meta device, world 8 (1-D) and a 2x4 mesh
(2 replicas of 4 shards), one forward and backward; nothing is allocated and no data moves.
Check: per-rank state is 16 Psi / S plus at most one padding row per parameter, and exactly 4x what
estimate-memory predicts for the shards; FULL_SHARD issues one all-gather per unit in forward and one per
block in backward, one reduce-scatter per unit (and one all-reduce per unit across replicas on the 2-D mesh),
with bytes equal to the gathered sizes x (S-1)/S.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from fullshard.cli.memory_estimate import estimate_memory, unit_parameters
from fullshard.engine.api import ShardingStrategy
from fullshard.testing.models import Block, GPTConfig, TinyGPT

ROOT = Path(__file__).resolve().parents[2]


def test_small_plans_match_the_formulas(tmp_path: Path) -> None:
    out = tmp_path / "plans.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    script = ROOT / "benchmarks" / "simulate.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--json", str(out)], env=env, timeout=300,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    plans = {p["mesh"]: p for p in json.loads(out.read_text())}
    assert set(plans) == {"8", "2x4"}
    assert plans["8"]["config"] == plans["2x4"]["config"]
    cfg = GPTConfig(**plans["8"]["config"])  # the model the script simulated, as it recorded it
    with torch.device("meta"):
        model = TinyGPT(cfg)
    units = unit_parameters(model, {Block})
    psi = sum(p.numel() for p in model.parameters())
    row_sum = sum(p[0].numel() if p.dim() > 1 else 1 for u in units for p in u)
    for mesh, shards, replicas in (("8", 8, 1), ("2x4", 4, 2)):
        plan = plans[mesh]
        assert plan["params"] == psi
        assert 16 * psi / shards <= plan["state_bytes"] <= 16 * psi / shards + 16 * row_sum, plan
        predicted = estimate_memory(units, shards * replicas, ShardingStrategy.FULL_SHARD if replicas == 1 else
                                    ShardingStrategy.HYBRID_SHARD, num_machines=replicas)  # fmt: skip
        assert plan["state_bytes"] == 4 * predicted.params
        full = [shards * 4 * sum(-(-p.shape[0] // shards) * (p[0].numel() if p.dim() > 1 else 1) for p in u)
                for u in units]  # fmt: skip
        assert plan["largest_unit_bytes"] == max(full)
        share = (shards - 1) / shards
        assert plan["calls"] == {"all_gather": 1 + 2 * 3, "reduce_scatter": 4, "all_reduce": 4 if replicas > 1 else 0}
        assert plan["comm_bytes"]["all_gather"] == sum(int(b * share) for b in [full[-1], *full[:-1], *full[:-1]])
        assert plan["comm_bytes"]["reduce_scatter"] == sum(int(b * share) for b in full)
        if replicas > 1:
            assert plan["comm_bytes"]["all_reduce"] == sum(
                int(2 * b / shards * (replicas - 1) / replicas) for b in full
            )
        formula = sum(plan["comm_formula"].values())
        assert 0.5 * formula < sum(plan["comm_bytes"].values()) < 1.5 * formula  # padding is large on a tiny model
        # whole_param_step + Muon on the blocks' matrices: every matrix owned by one rank, Newton-Schulz FLOPs
        # summed over owners = the unsharded optimizer's, the owners balanced to within one matrix
        w = plan["whole_step"]
        matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")]
        assert w["matrices"] == len(matrices) == 4 * cfg.n_layer
        ns = [5 * 2 * (2 * min(p.shape) ** 2 * max(p.shape) + min(p.shape) ** 3) for p in matrices]
        assert w["ns_flops_total"] == sum(ns)
        assert sum(ns) / shards <= w["ns_flops_max"] <= sum(ns) / shards + max(ns)
        numel = [p.numel() for p in matrices]
        assert w["held_bytes_max"] <= 12 * (sum(numel) / shards + max(numel))
        assert w["gather_bytes_max"] == w["scatter_bytes_max"]  # Newton-Schulz's bf16 input in, its result out
        assert 0 < w["exchange_bytes_mean"] <= 5 * 4 * sum(numel) / shards

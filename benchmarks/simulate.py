"""Plan a 1,024-rank run on a laptop: fullshard's sharding and one step's collectives under a fake process group.

    python benchmarks/simulate.py [--quick] [--json OUT]

For each model (the medium GPT of ``muon.py``, the issue's 840M GPT and a 7B-class GPT: 32 layers, width 4096,
32 heads, vocabulary 32000) and each layout (1-D meshes of 8, 64 and 1,024 ranks; a hybrid 2-D mesh of 8
replicas x 128 shards), this process becomes rank 0 of torch's fake process group (``FakeStore`` + backend
``"fake"``: collectives return at once and move nothing), builds the model on the meta device, wraps every
block and the root with ``fully_shard`` (FULL_SHARD; the engine keeps meta units on meta under this backend, see
``simulating`` in ``fullshard/engine/mesh.py``) and runs one forward and backward on meta token ids.
Nothing is allocated.

It reports, per rank: the bytes of parameter shards (x4 for params, grads and Adam's two moments: the
model state), the largest gathered unit, the collectives the engine issued in the step and the bytes it
recorded in ``COMM_STATS``; beside them the formulas (state 16 Psi / N; traffic 3 x 4 Psi (N-1)/N for FULL_SHARD,
with the hybrid mesh's all-reduce of the shard across replicas) and ``estimate-memory``'s peak for the same
configuration, one row per (model, mesh) under the machine's description. ``--quick`` runs the small cases
``tests/cli/test_simulate_scale.py`` checks (a tiny GPT, world 8 and a 2x4 mesh). ``--json`` writes every plan,
with the model's ``GPTConfig`` fields, so that a reader can rebuild the model it describes.

Matrix optimizers (``whole_param_step``, Muon on the blocks' 2-D matrices): from the same sharded model, each
matrix's owner as the hook plans it (``plan_owners``: shapes only), and per shard rank the bytes of its two
all-to-alls (Muon's step split at Newton-Schulz: its bf16 input to the owners, its bf16 result back, from the
engine's own row layouts: what ``nbytes`` sends), the whole tensors an owner holds during the step (the bf16
inputs), and its Newton-Schulz FLOPs (5 iterations of ``X X^T``, ``A A`` and ``B X`` on the ``m x n`` matrix,
``m <= n``: ``2 (2 m^2 n + m^3)`` each). Its second table gives the slowest rank's figures against the mean, and
against the forward and backward FLOPs of the simulated batch (``6 Psi tokens``): owners are whole matrices, so
once the shard group is larger than the number of matrices the slowest rank's Newton-Schulz stops falling with
``N`` (its largest matrix).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from fullshard import fully_shard
from fullshard.algorithms.whole_step import newton_schulz_cost, plan_owners
from fullshard.cli.memory_estimate import estimate_training
from fullshard.engine import model_params
from fullshard.engine.api import ShardingStrategy
from fullshard.engine.collectives import COMM_STATS
from fullshard.engine.unit_state import unit_states_in
from fullshard.testing.bench import describe_machine
from fullshard.testing.models import Block, GPTConfig, TinyGPT

MODELS = {
    # benchmarks/muon.py's medium GPT (8 x 512, sequence 64, 4 sequences per rank)
    "GPT-26M": (GPTConfig(vocab_size=512, block_size=64, n_layer=8, n_head=4, n_embd=512), 4),
    "GPT-840M": (GPTConfig(vocab_size=8192, block_size=128, n_layer=16, n_head=16, n_embd=2048), 2),
    "GPT-7B": (GPTConfig(vocab_size=32000, block_size=2048, n_layer=32, n_head=32, n_embd=4096), 1),
}
LAYOUTS = [(8,), (64,), (1024,), (8, 128)]
QUICK_MODELS = {"tiny": (GPTConfig(vocab_size=61, block_size=9, n_layer=3, n_head=3, n_embd=21), 2)}
QUICK_LAYOUTS = [(8,), (2, 4)]


@dataclass
class Plan:
    model: str
    config: dict[str, int | bool]  # the GPTConfig's fields
    mesh: str
    world: int
    params: int  # Psi
    state_bytes: int  # measured: 4 x this rank's padded parameter shards (params, grads, 2 Adam moments)
    state_formula: float  # 16 Psi / shard size
    largest_unit_bytes: int
    calls: dict[str, int]
    comm_bytes: dict[str, int]
    comm_formula: dict[str, float]
    estimate_peak: int
    estimate_gathered: int
    seconds: float
    whole_step: dict[str, float]  # see whole_step_plan


NS_STEPS = 5  # torch.optim.Muon's default


def newton_schulz_flops(shape: tuple[int, ...]) -> int:
    """FLOPs of Muon's Newton-Schulz on one whole matrix (``torch.optim._muon``: 5 quintic iterations)."""
    m, n = sorted(shape)
    return NS_STEPS * 2 * (2 * m * m * n + m**3)


def whole_step_plan(model: torch.nn.Module, shards: int, tokens: int) -> dict[str, float]:
    """Per shard rank, what ``whole_param_step`` with Muon (split at Newton-Schulz) on the blocks' matrices costs;
    the slowest rank's figures and the means (see the module docstring)."""
    matrices = [i for i in model_params(model) if i.sp is not None and len(i.sp.shape) == 2 and "blocks" in i.fqn]
    owners = plan_owners([newton_schulz_cost(tuple(i.sp.shape)) for i in matrices], shards)
    gather_in, scatter_out, held, flops = ([0] * shards for _ in range(4))
    for info, owner in zip(matrices, owners, strict=True):
        rows = [info.sp.layout.for_rank(r).local_numel * 2 for r in range(shards)]  # bf16 bytes per rank
        off_owner = sum(rows) - rows[owner]
        gather_in[owner] += off_owner  # Newton-Schulz's bf16 input (the split step: [Note: split Muon steps])
        scatter_out[owner] += off_owner  # its bf16 result
        held[owner] += 2 * math.prod(info.sp.shape)
        flops[owner] += newton_schulz_flops(info.sp.shape)
    psi = sum(p.numel() for p in model.parameters())
    return {
        "matrices": len(matrices),
        "ranks_owning": sum(1 for r in range(shards) if flops[r]),
        "gather_bytes_max": max(gather_in),
        "scatter_bytes_max": max(scatter_out),
        "exchange_bytes_mean": (sum(gather_in) + sum(scatter_out)) / shards,
        "held_bytes_max": max(held),
        "ns_flops_max": max(flops),
        "ns_flops_mean": sum(flops) / shards,
        "ns_flops_total": sum(flops),
        "fwd_bwd_flops_per_rank": 6 * psi * tokens,
    }


def simulate(name: str, cfg: GPTConfig, batch: int, layout: tuple[int, ...]) -> Plan:
    world = 1
    for size in layout:
        world *= size
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", layout) if len(layout) == 2 else None
        with torch.device("meta"):
            model = TinyGPT(cfg)
        psi = sum(p.numel() for p in model.parameters())
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        groups = [s.group for s in unit_states_in(model) if s.group is not None]
        shard_bytes = sum(g.flat_shard.numel() * g.flat_shard.element_size() for g in groups)
        largest = max(g.flat_full.numel() * g.flat_full.element_size() for g in groups)
        ids = torch.zeros(batch, cfg.block_size, dtype=torch.long, device="meta")
        whole = whole_step_plan(model, layout[-1], batch * cfg.block_size)
        COMM_STATS.reset()
        model(ids, ids).backward()
        calls, moved = dict(COMM_STATS.calls), dict(COMM_STATS.bytes)
    finally:
        dist.destroy_process_group()
    shards = layout[-1]
    replicas = world // shards
    full = 4 * psi
    formula = {
        "all_gather": 2 * full * (shards - 1) / shards,
        "reduce_scatter": full * (shards - 1) / shards,
        "all_reduce": 2 * (full / shards) * (replicas - 1) / replicas,
    }
    strategy = ShardingStrategy.HYBRID_SHARD if len(layout) == 2 else ShardingStrategy.FULL_SHARD
    with torch.device("meta"):
        meta_model = TinyGPT(cfg)
    est = estimate_training(meta_model, {Block}, world, strategy, batch=batch, seq=cfg.block_size,
                            num_machines=replicas)  # fmt: skip
    return Plan(
        name, asdict(cfg), "x".join(map(str, layout)), world, psi, 4 * shard_bytes, 16 * psi / shards, largest,
        calls, moved, formula, est.peak, est.gathered, time.perf_counter() - start, whole,
    )  # fmt: skip


def run(models: dict[str, tuple[GPTConfig, int]], layouts: list[tuple[int, ...]]) -> list[Plan]:
    return [simulate(name, cfg, batch, layout) for name, (cfg, batch) in models.items() for layout in layouts]


def report(plans: list[Plan]) -> None:
    gib = 2**30
    print(f"{'model':9} {'mesh':7} {'state GiB':>9} {'16Psi/N':>8} {'unit MiB':>8} {'AG/RS/AR calls':>14} "
          f"{'comm GiB':>9} {'formula':>8} {'est. peak':>9}")  # fmt: skip
    for p in plans:
        calls = "/".join(str(p.calls[k]) for k in ("all_gather", "reduce_scatter", "all_reduce"))
        moved, formula = sum(p.comm_bytes.values()), sum(p.comm_formula.values())
        print(f"{p.model:9} {p.mesh:7} {p.state_bytes / gib:9.3f} {p.state_formula / gib:8.3f} "
              f"{p.largest_unit_bytes / 2**20:8.1f} {calls:>14} {moved / gib:9.2f} {formula / gib:8.2f} "
              f"{p.estimate_peak / gib:9.2f}")  # fmt: skip
    print("\nwhole_param_step + Muon on the blocks' matrices, per shard rank (max = the slowest rank):")
    print(f"{'model':9} {'mesh':7} {'owners':>11} {'NS GFLOP max':>12} {'max/mean':>8} {'NS/fwd+bwd':>10} "
          f"{'a2a MiB max':>11} {'held MiB':>9}")  # fmt: skip
    for p in plans:
        w = p.whole_step
        ns_share = w["ns_flops_max"] / w["fwd_bwd_flops_per_rank"]
        a2a = (w["gather_bytes_max"] + w["scatter_bytes_max"]) / 2**20
        owners = f"{w['ranks_owning']:.0f}/{p.mesh.split('x')[-1]}"
        print(f"{p.model:9} {p.mesh:7} {owners:>11} {w['ns_flops_max'] / 1e9:12.1f} "
              f"{w['ns_flops_max'] / w['ns_flops_mean']:8.2f} {ns_share:10.3f} "
              f"{a2a:11.1f} {w['held_bytes_max'] / 2**20:9.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the test's small cases only")
    parser.add_argument("--json", default=None, help="write the plans to this file")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.simplefilter("ignore", FutureWarning)
    print(f"machine: {describe_machine()}")
    plans = run(QUICK_MODELS, QUICK_LAYOUTS) if args.quick else run(MODELS, LAYOUTS)
    report(plans)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(p) for p in plans], f, indent=1)


if __name__ == "__main__":
    main()

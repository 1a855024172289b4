"""torch.compile under sharding: fullshard's ``fully_shard`` and torch FSDP2, each eager and with compiled blocks.

    python benchmarks/compile.py [--layers 8] [--width 512] [--steps 10] [--backend inductor] [--order compile_first]

Prints the machine, then per system (fullshard fully_shard, torch FSDP2) and mode (eager, blocks compiled): the
first step's time (for compiled blocks: dynamo tracing plus the backend's compilation), the median of the later
steps, and the losses of the first steps (compiled and eager must agree to the backend's tolerance); then the
compiled steps of fullshard over torch FSDP2's, and each system's compile gain (eager median over compiled).
Each (system, mode) runs in fresh ranks with an empty inductor cache, in the order fullshard eager, torch eager,
fullshard compiled, torch compiled; torchtitan's recipe: ``block.compile()`` then ``fully_shard(block)``
(``--order shard_first`` compiles after sharding). 2 gloo ranks on CPU, the GPT of ``benchmarks/train.py steps``;
the systems (``kit.COMPILE``) are built by ``benchmarks/kit.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from kit import COMPILE as SYSTEMS
from kit import system

from fullshard.testing.bench import describe_machine, on_fresh_ranks
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch


def _run(rank: int, world: int, name: str, compiled: bool, cfg: GPTConfig, args: dict[str, Any]) -> dict:
    # A cold compile cache for every run (inductor reads the variable when it compiles): the first system compiled
    # must not leave the second its kernels, or the first-step times compare a compile with a cache hit.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"fullshard-compile-{rank}-")
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    if compiled and args["order"] == "compile_first":
        for block in model.blocks:
            block.compile(backend=args["backend"])
    model = system(name).build(model)
    if compiled and args["order"] == "shard_first":
        for block in model.blocks:
            block.compile(backend=args["backend"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per = args["batch"] // world
    times, losses = [], []
    for step in range(args["steps"]):
        x, y = make_batch(cfg, args["batch"], seed=step)
        dist.barrier()
        start = time.perf_counter()
        loss = model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"first_s": times[0], "step_s": statistics.median(times[2:] or times[1:]), "losses": losses[:3]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--order", choices=("compile_first", "shard_first"), default="compile_first")
    args = p.parse_args()
    print(describe_machine())
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.width)
    rows: dict[tuple[str, bool], dict] = {}
    for compiled in (False, True):
        for name in SYSTEMS:
            per_rank = on_fresh_ranks(_run, name, compiled, cfg, vars(args), timeout_s=3 * 3600)
            row = {
                "first_s": max(r["first_s"] for r in per_rank),
                "step_s": max(r["step_s"] for r in per_rank),
                "losses": per_rank[0]["losses"],
            }
            rows[(name, compiled)] = row
            mode = f"blocks compiled ({args.backend})" if compiled else "eager"
            print(
                f"{name:22} {mode:28} first step {row['first_s']:7.2f} s   median step {row['step_s'] * 1e3:7.1f} ms"
                f"   losses {', '.join(f'{v:.5f}' for v in row['losses'])}",
                flush=True,
            )
    ours, theirs = rows[(SYSTEMS[0], True)], rows[(SYSTEMS[1], True)]
    print(f"compiled: fullshard / torch FSDP2 step time {ours['step_s'] / theirs['step_s']:.3f}")
    for name in SYSTEMS:
        gain = rows[(name, False)]["step_s"] / rows[(name, True)]["step_s"]
        print(f"{name}: eager step / compiled step {gain:.3f}")


if __name__ == "__main__":
    main()

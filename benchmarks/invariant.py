"""Step time of world-size-invariant mode (issue 27 §1) against the default, on 1 and 2 gloo ranks.

``python benchmarks/invariant.py [--layers 4 --width 256 --micro-batches 4 --rows 2 --steps 8 --passes 2]``

A TinyGPT with one ``fully_shard`` unit per block, AdamW, a global batch of ``micro-batches x rows`` sequences; each
of ``N`` ranks runs its ``G/N`` micro-batches per step. Three loops:

- ``default, sync each micro-batch``: gradient sync on for every micro-batch (sharded accumulation);
- ``default, no_sync``: ``set_requires_gradient_sync(False)`` for all but the last micro-batch;
- ``invariant``: ``fully_shard(..., invariant_micro_batches=G)``, sync left on (the engine accumulates).

The three take turns step by step in the same ranks. Prints the median step time of each (ms, after one warm-up
step; a step ends when its slowest rank does), per pass, and the median over passes against the first loop.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fullshard import fully_shard
from fullshard.testing import WorkerPool
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch

LOOPS = ["default, sync each micro-batch", "default, no_sync", "invariant"]


def _build(loop: str, cfg: GPTConfig, micro_batches: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    g = micro_batches if loop == "invariant" else None
    for block in model.blocks:
        fully_shard(block, invariant_micro_batches=g)
    fully_shard(model, invariant_micro_batches=g)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def steps(rank: int, world: int, cfg: GPTConfig, micro_batches: int, rows: int, n_steps: int) -> dict[str, list[float]]:
    """Every loop's step times; the loops take turns step by step (rotating who goes first), so that the load
    of a shared machine falls on all of them alike."""
    built = {loop: _build(loop, cfg, micro_batches) for loop in LOOPS}
    per_rank = micro_batches // world
    times: dict[str, list[float]] = {loop: [] for loop in LOOPS}
    for step in range(n_steps + 1):
        x, y = make_batch(cfg, micro_batches * rows, seed=step)
        for i in range(len(LOOPS)):
            loop = LOOPS[(step + i) % len(LOOPS)]
            model, opt = built[loop]
            start = time.perf_counter()
            for k in range(per_rank):
                if loop == "default, no_sync":
                    model.set_requires_gradient_sync(k == per_rank - 1)
                first = (rank * per_rank + k) * rows
                (model(x[first : first + rows], y[first : first + rows]) / per_rank).backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            if step:  # the first is a warm-up
                times[loop].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.width)
    params = sum(p.numel() for p in TinyGPT(cfg).parameters())
    print(f"TinyGPT {args.layers} layers, width {args.width} ({params / 1e6:.2f}M parameters), G={args.micro_batches}")
    for world in args.worlds:
        pool = WorkerPool(world)
        medians: dict[str, list[float]] = {loop: [] for loop in LOOPS}
        for _ in range(args.passes):
            per_rank = pool.run(steps, cfg, args.micro_batches, args.rows, args.steps)
            for loop in LOOPS:
                step_times = [max(ts) for ts in zip(*(r[loop] for r in per_rank))]  # the slowest rank ends a step
                medians[loop].append(1000 * statistics.median(step_times))
        pool.close()
        base = statistics.median(medians[LOOPS[0]])
        for loop in LOOPS:
            ms = statistics.median(medians[loop])
            runs = ", ".join(f"{m:.0f}" for m in medians[loop])
            print(f"N={world}  {loop:<32} {ms:8.1f} ms  ({runs})  x{ms / base:.2f}")


if __name__ == "__main__":
    main()

"""bf16 compute against fp32 compute on this CPU, in one run, interleaved: which mixed-precision choice to make.

    python benchmarks/precision.py [--quick] [--steps 8] [--layers 4] [--width 512]

Prints the machine (``fullshard.testing.bench.describe_machine``: the CPU's flags, native bf16 or not; and
torch's own view: its CPU capability and whether :mod:`fullshard.engine.cpu_bf16` counts bf16 as native), then:
1. a matmul (width x 4*width, batch*seq rows) in fp32 and in bf16, alternated, median time each;
2. ``FullyShardedDataParallel`` FULL_SHARD on 2 gloo CPU ranks training a GPT three ways, one step of each in
   turn: fp32 throughout; bf16 compute (``param_dtype`` = ``reduce_dtype`` = bf16); and fp32 compute with bf16
   on the wire (``reduce_dtype=bf16`` only), the fix :mod:`fullshard.engine.cpu_bf16` recommends on CPUs
   without native bf16. Median step time of the slowest rank and its ratio to fp32, and the loss after the
   last step (the three train the same data from the same initialisation).
The machine's load (``uptime``) is printed beside the figures: timings on a shared machine are only
comparable within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from kit import ours_fsdp

from fullshard import MixedPrecision
from fullshard.engine.cpu_bf16 import has_native_bf16
from fullshard.testing.bench import describe_machine, on_fresh_ranks
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch

POLICIES = {
    "fp32": None,
    "bf16 compute (param_dtype=bf16)": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
    "fp32 compute, bf16 reduce": MixedPrecision(reduce_dtype=torch.bfloat16),
}


def machine() -> str:
    return (
        f"{describe_machine()}; torch's CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"native bf16 as fullshard sees it: {has_native_bf16()}"
    )


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def matmul_times(rows: int, width: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    a32, b32 = torch.randn(rows, width), torch.randn(width, 4 * width)
    pairs = {"fp32": (a32, b32), "bf16": (a32.bfloat16(), b32.bfloat16())}
    times: dict[str, list[float]] = {k: [] for k in pairs}
    for _ in range(repeats):
        for name, (a, b) in pairs.items():
            start = time.perf_counter()
            a @ b
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def _train(rank: int, world: int, cfg: GPTConfig, steps: int, batch: int) -> dict[str, tuple[float, float]]:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the bf16-on-this-CPU warning is the point of the run, not news
    models, optims = {}, {}
    for name, mp in POLICIES.items():
        torch.manual_seed(0)
        models[name] = ours_fsdp(TinyGPT(cfg), mixed_precision=mp)
        optims[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-3)
    times: dict[str, list[float]] = {name: [] for name in POLICIES}
    losses: dict[str, float] = {}
    for step in range(steps):
        x, y = make_batch(cfg, batch, seed=step * world + rank)
        for name in POLICIES:  # interleaved: the machine's load hits the three alike
            dist.barrier()
            start = time.perf_counter()
            loss = models[name](x, y)
            loss.backward()
            optims[name].step()
            optims[name].zero_grad()
            times[name].append(time.perf_counter() - start)
            losses[name] = float(loss)
    warm = max(1, steps // 4)
    return {name: (statistics.median(times[name][warm:]), losses[name]) for name in POLICIES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps (seconds)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.layers, args.width = 4, 2, 256
    cfg = GPTConfig(vocab_size=2048, block_size=128, n_layer=args.layers, n_head=8, n_embd=args.width)
    print(f"machine: {machine()}")
    print(load())
    mm = matmul_times(args.batch * cfg.block_size, args.width, repeats=max(5, args.steps))
    print(
        f"matmul {args.batch * cfg.block_size}x{args.width} @ {args.width}x{4 * args.width}: "
        f"fp32 {mm['fp32'] * 1e3:.2f} ms, bf16 {mm['bf16'] * 1e3:.2f} ms, bf16/fp32 = {mm['bf16'] / mm['fp32']:.2f}"
    )
    results = on_fresh_ranks(_train, cfg, args.steps, args.batch)  # bf16 on AVX2 only: minutes when loaded
    fp32 = max(r["fp32"][0] for r in results)
    print(f"FSDP FULL_SHARD, 2 gloo ranks, GPT {args.layers}x{args.width}, batch {args.batch}x{cfg.block_size}/rank:")
    print(f"  {'policy':34} {'step ms':>9} {'vs fp32':>8} {'last loss':>10}")
    for name in POLICIES:
        step = max(r[name][0] for r in results)  # the slowest rank sets the pace
        print(f"  {name:34} {step * 1e3:9.1f} {step / fp32:8.2f} {results[0][name][1]:10.4f}")
    print(load())


if __name__ == "__main__":
    main()

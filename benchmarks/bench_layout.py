"""Why one flat all-gather per unit: measure it against one all-gather per parameter, on 2 gloo ranks.

    python benchmarks/bench_layout.py [--width 256] [--repeats 30]

For the parameters of one transformer block, compares (a) one ``all_gather_into_tensor`` per parameter,
each receiving its full tensor directly, with (b) what fullshard does: one all-gather of the unit's flat
shard followed by one ``split_with_sizes_copy`` into the parameters' full blocks. Prints median
milliseconds per unit gather for each and the ratio a/b.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fullshard.testing import run_on_ranks


def block_shapes(width: int) -> list[tuple[int, ...]]:
    hidden = 4 * width + 1
    return [
        (width,),
        (width,),
        (3 * width, width),
        (width, width),
        (width,),
        (width,),
        (width,),
        (hidden, width),
        (hidden,),
        (width, hidden),
        (width,),
    ]


def _measure(rank: int, world: int, width: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    shapes = block_shapes(width)
    rows = [-(-s[0] // world) for s in shapes]
    row_numel = [int(torch.Size(s[1:]).numel()) for s in shapes]
    shard_numels = [r * n for r, n in zip(rows, row_numel)]
    shards = [torch.randn(n) for n in shard_numels]
    fulls = [torch.empty(world * n) for n in shard_numels]
    flat_shard = torch.cat(shards)
    gathered = torch.empty(world * flat_shard.numel())
    blocks = torch.empty(world * flat_shard.numel())
    outs = list(torch.split(blocks, [world * n for n in shard_numels]))

    def per_param() -> None:
        for out, shard in zip(fulls, shards):
            dist.all_gather_into_tensor(out, shard)

    def flat() -> None:
        dist.all_gather_into_tensor(gathered, flat_shard)
        views = [o.view(world, -1) for o in outs]
        torch.split_with_sizes_copy(gathered.view(world, -1), shard_numels, dim=1, out=views)

    result = {}
    for name, fn in (("per_param", per_param), ("flat", flat)):
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        result[name] = statistics.median(times) * 1e3
    # The two must agree: parameter i's padded full tensor in both layouts.
    for i, out in enumerate(outs):
        if not torch.equal(out, fulls[i]):
            raise AssertionError(f"[rank {rank}] layouts disagree for parameter {i}")
    result["bytes"] = blocks.numel() * 4
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    results = run_on_ranks(_measure, 2, args.width, args.repeats)
    per_param = max(r["per_param"] for r in results)
    flat = max(r["flat"] for r in results)
    print(f"unit of {len(block_shapes(args.width))} parameters, {results[0]['bytes'] / 1e6:.2f} MB gathered")
    print(f"per-parameter all-gathers: {per_param:.2f} ms")
    print(f"flat all-gather + copy-out: {flat:.2f} ms")
    print(f"ratio per-parameter / flat: {per_param / flat:.2f}")


if __name__ == "__main__":
    main()

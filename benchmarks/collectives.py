"""gloo's reduce-scatter and all-gather against point-to-point versions, and an alpha-beta model of this machine's gloo.

    python benchmarks/collectives.py [--quick] [--worlds 2 4] [--json bench_collectives.json]

For each group size it spawns that many gloo CPU ranks (one thread each) and times, for full-buffer sizes
from a few KB to 50 MB (MB = 10^6 bytes, the all-ranks size of one unit's buffer) in fp32 and bf16:

- reduce-scatter: gloo's ``reduce_scatter_tensor`` (torch 2.13: an all-reduce of a clone, then a copy),
  :func:`fullshard.engine.p2p.pairwise_reduce_scatter` and :func:`fullshard.testing.bench.ring_reduce_scatter`;
- all-gather: gloo's ``all_gather_into_tensor`` and :func:`~fullshard.engine.p2p.pairwise_all_gather`;
- all-reduce: gloo's ``all_reduce`` (what DDP runs), for its CPU cost per byte;
- a two-rank exchange (ranks 0 and 1 send each other ``m`` bytes at once), to which the alpha-beta model
  ``t = alpha + beta m`` is fitted by least squares on relative error (each point weighted by 1 / its time, so that
  the small sizes, which carry alpha, count as much as the large ones).

Below 2 MB a sample times several calls back to back (about 2 MB in all) and divides. Each time is the slowest
rank's (the collective is done when the last rank is), the median over repetitions; the variants are
interleaved inside every repetition (rotating which goes first), so that load from other processes on the
machine falls on all of them alike. The table shows each time and, in brackets, its ratio to the model's
prediction for that algorithm (``n`` ranks, ``B`` bytes):

    gloo reduce-scatter, all-reduce    2(n-1) alpha + 2 B (n-1)/n beta
    ring reduce-scatter, gloo all-gather   (n-1) alpha +   B (n-1)/n beta
    pairwise (all sends at once)           alpha +   B (n-1)/n beta

It starts with the machine (``fullshard.testing.bench.describe_machine``) and ends with the crossover per
collective and group size (the smallest size from which the point-to-point
version wins at that size and every larger one), which ``P2P_MIN_BYTES`` in ``fullshard/engine/p2p.py``
encodes, and the load average before and after. ``--json`` writes every median and the fit.

The last column is the CPU time a collective costs (user + kernel, every thread of the process, mean over the
ranks) per MB each rank sends (``B (n-1)/n``, twice that for an all-reduce and gloo's reduce-scatter): on
loopback TCP every byte is copied into a socket by its sender and out by the receiver, on the same cores that
compute, so in training the bytes cost compute time wherever they overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fullshard.engine import p2p
from fullshard.testing.bench import describe_machine, machine, on_fresh_ranks, ring_reduce_scatter

SIZES_MB = [0.004, 0.05, 0.2, 0.5, 1, 2, 5, 10, 20, 50]
QUICK_SIZES_MB = [0.05, 0.2, 2, 20]
BATCH_MB = 2.0  # below this size a sample is several calls back to back, about this many MB in all
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


Op = Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup], Any]
VARIANTS: dict[str, dict[str, Op]] = {
    "reduce_scatter": {
        "gloo": lambda out, full, pg: _reduce_scatter_single(out, full, group=pg, async_op=True),
        "pairwise": p2p.pairwise_reduce_scatter,
        "ring": ring_reduce_scatter,
    },
    "all_gather": {
        "gloo": lambda full, shard, pg: _all_gather_single(full, shard, group=pg, async_op=True),
        "pairwise": p2p.pairwise_all_gather,
    },
    "all_reduce": {"gloo": lambda full, _, pg: dist.all_reduce(full, group=pg, async_op=True)},
}
SENT_FACTOR = {("reduce_scatter", "gloo"): 2, ("all_reduce", "gloo"): 2}  # x B (n-1)/n sent per rank; else 1


def _exchange(buf: torch.Tensor, recv: torch.Tensor, pg: dist.ProcessGroup) -> list[dist.Work]:
    rank = pg.rank()
    if rank > 1:
        return []
    return [pg.send([buf], 1 - rank, 77), pg.recv([recv], 1 - rank, 77)]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # the process: the caller's thread and gloo's
    return usage.ru_utime + usage.ru_stime


def _timed(fn: Callable[[], Any], times: int) -> tuple[float, float]:
    """Seconds and CPU seconds per call of ``times`` calls back to back (small sizes: spreads the barrier's
    exit skew)."""
    dist.barrier()
    start, cpu = time.perf_counter(), _cpu_s()
    for _ in range(times):
        work = fn()
        for w in work if isinstance(work, list) else [work]:
            w.wait()
    return (time.perf_counter() - start) / times, (_cpu_s() - cpu) / times


def _measure(
    rank: int, world: int, sizes_mb: list[float], dtypes: list[str], reps: int
) -> dict[str, list[tuple[float, float]]]:
    """Per (what, dtype, MB, variant): this rank's (time, CPU time) of every repetition."""
    torch.set_num_threads(1)
    pg = dist.group.WORLD
    times: dict[str, list[tuple[float, float]]] = {}
    gen = torch.Generator().manual_seed(rank)
    for rep in range(reps + 1):  # repetition 0 warms up (connections, allocator) and is dropped
        for mb in sizes_mb:
            for dname in dtypes:
                dtype = DTYPES[dname]
                numel = max(world, int(mb * 1e6 * 8 / torch.finfo(dtype).bits) // world * world)
                full = torch.randn(numel, generator=gen).to(dtype)
                shard = torch.empty(numel // world, dtype=dtype)
                gathered = torch.empty_like(full)
                runs: list[tuple[str, Callable[[], Any]]] = []
                for name, op in VARIANTS["reduce_scatter"].items():
                    runs.append((f"reduce_scatter|{dname}|{mb}|{name}", lambda op=op, s=shard, f=full: op(s, f, pg)))
                for name, op in VARIANTS["all_gather"].items():
                    runs.append((f"all_gather|{dname}|{mb}|{name}", lambda op=op, g=gathered, s=shard: op(g, s, pg)))
                for name, op in VARIANTS["all_reduce"].items():
                    runs.append((f"all_reduce|{dname}|{mb}|{name}", lambda op=op, g=gathered: op(g, None, pg)))
                if dname == dtypes[0]:
                    other = torch.empty_like(full)
                    runs.append((f"exchange|{dname}|{mb}|p2p", lambda f=full, o=other: _exchange(f, o, pg)))
                shift = rep % len(runs)
                batch = max(1, round(BATCH_MB / mb))
                for key, fn in runs[shift:] + runs[:shift]:
                    measured = _timed(fn, batch)
                    if rep:
                        times.setdefault(key, []).append(measured)
    return times


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of ``t = alpha + beta m`` on relative error: rows and targets divided by t."""
    m = np.array([b for b, _ in points])
    t = np.array([s for _, s in points])
    design = np.stack([np.ones_like(m), m], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


def model_s(kind: str, variant: str, n: int, nbytes: float, alpha: float, beta: float) -> float:
    share = nbytes * (n - 1) / n
    if (kind, variant) in SENT_FACTOR:
        return 2 * (n - 1) * alpha + 2 * share * beta
    if variant == "pairwise":
        return alpha + share * beta
    return (n - 1) * alpha + share * beta  # ring reduce-scatter, gloo's (ring) all-gather


def summarise(per_rank: list[dict[str, list[tuple[float, float]]]], world: int) -> dict[str, Any]:
    medians, cpu_medians = {}, {}
    for key in per_rank[0]:
        reps = range(len(per_rank[0][key]))
        medians[key] = statistics.median(max(r[key][i][0] for r in per_rank) for i in reps)
        cpu_medians[key] = statistics.median(sum(r[key][i][1] for r in per_rank) / world for i in reps)
    points = []
    for key, seconds in medians.items():
        what, _, mb, _ = key.split("|")
        if what == "exchange":
            points.append((float(mb) * 1e6, seconds))
    alpha, beta = fit_alpha_beta(points)
    rows = []
    for key, seconds in medians.items():
        what, dname, mb, variant = key.split("|")
        if what == "exchange":
            predicted = alpha + beta * float(mb) * 1e6
        else:
            predicted = model_s(what, variant, world, float(mb) * 1e6, alpha, beta)
        rows.append({"collective": what, "dtype": dname, "mb": float(mb), "variant": variant, "s": seconds})
        rows[-1]["model_s"] = predicted
        sent_mb = float(mb) * (world - 1) / world * SENT_FACTOR.get((what, variant), 1)
        rows[-1]["cpu_s_per_mb_sent"] = cpu_medians[key] / sent_mb
    return {"world": world, "alpha_s": alpha, "beta_s_per_byte": beta, "rows": rows}


def crossovers(summary: dict[str, Any]) -> dict[str, float | None]:
    """Per collective and dtype: smallest MB from which pairwise beats gloo there and at every larger size."""
    out: dict[str, float | None] = {}
    by: dict[tuple[str, str], dict[float, dict[str, float]]] = {}
    for row in summary["rows"]:
        if row["collective"] not in ("exchange", "all_reduce"):
            by.setdefault((row["collective"], row["dtype"]), {}).setdefault(row["mb"], {})[row["variant"]] = row["s"]
    for (what, dname), sizes in by.items():
        wins = [mb for mb in sorted(sizes) if sizes[mb]["pairwise"] < sizes[mb]["gloo"]]
        threshold = None
        for mb in sorted(sizes, reverse=True):
            if mb not in wins:
                break
            threshold = mb
        out[f"{what} {dname}"] = threshold
    return out


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def report(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    n = summary["world"]
    title = (
        f"{n} gloo CPU ranks: median ms of the slowest rank (ratio to the alpha-beta model); "
        f"alpha = {summary['alpha_s'] * 1e6:.0f} us, 1/beta = {1 / summary['beta_s_per_byte'] / 1e9:.2f} GB/s"
    )
    table = Table(title=title)
    variants = ["gloo", "pairwise", "ring"]
    for col in ("collective", "dtype", "MB", *variants, "pairwise / gloo", "CPU ms / MB sent: gloo, pairwise"):
        table.add_column(col, justify="right")
    cells: dict[tuple[str, str, float], dict[str, dict[str, float]]] = {}
    for row in summary["rows"]:
        cells.setdefault((row["collective"], row["dtype"], row["mb"]), {})[row["variant"]] = row
    for (what, dname, mb), by_variant in sorted(cells.items()):
        if what == "exchange":
            row = by_variant["p2p"]
            table.add_row("p2p exchange", dname, f"{mb:g}", f"{row['s'] * 1e3:.2f} ({row['s'] / row['model_s']:.2f})")
            continue
        shown = []
        for variant in variants:
            row = by_variant.get(variant)
            shown.append(f"{row['s'] * 1e3:.2f} ({row['s'] / row['model_s']:.2f})" if row else "-")
        ratio = f"{by_variant['pairwise']['s'] / by_variant['gloo']['s']:.2f}" if "pairwise" in by_variant else "-"
        per_mb = [by_variant[v]["cpu_s_per_mb_sent"] for v in ("gloo", "pairwise") if v in by_variant]
        cpu = ", ".join(f"{seconds * 1e3:.2f}" for seconds in per_mb)
        table.add_row(what, dname, f"{mb:g}", *shown, ratio, cpu)
    console = Console(width=160)
    console.print(table)
    for key, mb in crossovers(summary).items():
        console.print(f"  {n} ranks, {key}: pairwise wins from {mb} MB up" if mb is not None else f"  {key}: gloo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES_MB} MB, fp32 only, 3 repetitions")
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--reps", type=int, default=None, help="repetitions per size (default 7, quick 3)")
    parser.add_argument("--sizes", type=float, nargs="*", default=None, help="full-buffer sizes in MB")
    parser.add_argument("--json", default="bench_collectives.json", help="where to write the medians and fit")
    args = parser.parse_args()
    sizes = args.sizes or (QUICK_SIZES_MB if args.quick else SIZES_MB)
    dtypes = ["fp32"] if args.quick else list(DTYPES)
    reps = args.reps or (3 if args.quick else 7)
    out: dict[str, Any] = {"machine": machine(), "torch": torch.__version__, "load_before": _load(), "worlds": []}
    print(f"machine: {describe_machine()}")
    for world in args.worlds:
        # The full sweep on 4 ranks of 2 busy cores takes a while.
        per_rank = on_fresh_ranks(_measure, sizes, dtypes, reps, world=world, timeout_s=3 * 3600)
        summary = summarise(per_rank, world)
        summary["crossover_mb"] = crossovers(summary)
        out["worlds"].append(summary)
        report(summary)
        out["load_after"] = _load()
        print(f"load average now: {out['load_after']}")
        with open(args.json, "w") as f:  # after every group size: a long sweep keeps what it measured
            json.dump(out, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

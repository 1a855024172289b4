"""``train.py steps`` and ``layout``: step time, CPU, traffic and state of each system against its baseline (or one
system's profiled breakdown, ``--trace``); one flat all-gather per unit against one per parameter (see ``train.py``)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from kit import (
    DDP,
    GLOO_NATIVE,
    OURS_FSDP_BF16_ON_DEMAND,
    OURS_FSDP_BF16_PREFETCH_ALL,
    SYSTEMS,
    TRACE_DEFAULT,
    UNCHECKED,
    system,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fullshard.engine import shm, trace
from fullshard.engine.collectives import COMM_STATS
from fullshard.testing.bench import (
    on_fresh_ranks,
)
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch

WORLD = 2  # gloo CPU ranks
COUNTED_STEPS = 2  # steps whose collective bytes are counted (see Runner.step)


# ==== steps: speed ==========================================================================================


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes this rank moves through c10d collectives, as ring algorithms move them."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.bytes = 0.0

    def __enter__(self) -> CollectiveBytes:
        self._shared_before = shm.TRAFFIC.sent  # what goes through shared memory between ranks of one host
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.bytes += shm.TRAFFIC.sent - self._shared_before
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        if func.namespace == "c10d":
            self.bytes += self._bytes(name, args)
        return func(*args, **(kwargs or {}))

    def _bytes(self, name: str, args: tuple) -> float:
        share = (self.world - 1) / self.world

        def nbytes(t: Any) -> int:
            if isinstance(t, torch.Tensor):
                return t.numel() * t.element_size()
            if isinstance(t, (list, tuple)):
                return sum(nbytes(x) for x in t)
            return 0

        if name.startswith(("_allgather_base", "allgather_into_tensor")):
            return nbytes(args[0]) * share  # output: the full tensor
        if name.startswith("allgather"):
            return nbytes(args[0]) * share
        if name.startswith(("_reduce_scatter_base", "reduce_scatter_tensor")):
            return nbytes(args[1]) * share  # input: the full tensor
        if name.startswith("reduce_scatter"):
            return nbytes(args[1]) * share
        if name.startswith("allreduce"):
            return 2 * nbytes(args[0]) * share
        if name.startswith("send"):  # point-to-point collectives (fullshard/engine/p2p.py): count what leaves this rank
            return nbytes(args[0])
        return 0.0


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += local(value).numel() * value.element_size()
    return total


THEORY_FACTOR = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 2}


class Runner:
    """One system built on this rank: its model, optimizer and per-step measurements.

    ``step`` times one training step (forward, backward, optimizer) after a barrier, and records the process's
    CPU time over it (every thread: the training thread, gloo's, the kernel's work for its sockets), the part of
    it spent in the kernel (on gloo's loopback TCP: mostly copying the collectives' bytes in and out of sockets)
    and its minor page faults (fresh memory the allocator had to map and the kernel to zero).
    """

    def __init__(self, name: str, cfg: GPTConfig) -> None:
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        self.name, self.cfg, self.system = name, cfg, system(name)
        self.model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.model = self.system.build(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.kernel: list[float] = []
        self.faults: list[int] = []
        self.comm: list[float] = []
        self.waits: list[float] = []

    def step(self, rank: int, world: int, batch: int, seed: int) -> None:
        per = batch // world
        x, y = make_batch(self.cfg, batch, seed=seed)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        # Bytes are counted in the first two steps only, which the medians leave out (``_warm``): the counting
        # dispatch mode runs Python around every aten call, which would charge a system for its number of ops.
        counter = CollectiveBytes(world) if len(self.times) < COUNTED_STEPS else contextlib.nullcontext()
        with self.system.environment():
            dist.barrier()
            COMM_STATS.reset()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            with counter:
                loss = self.model(x, y)
                loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)
            self.times.append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu.append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
        self.kernel.append(after.ru_stime - usage.ru_stime)
        self.faults.append(after.ru_minflt - usage.ru_minflt)
        if isinstance(counter, CollectiveBytes):
            self.comm.append(counter.bytes)
        self.waits.append(COMM_STATS.wait_s["all_gather"])

    def result(self, warm: int) -> dict[str, Any]:
        return {
            "step_s": statistics.median(self.times[warm:]),
            "times": self.times[warm:],
            "cpu_s": statistics.median(self.cpu[warm:]),
            "kernel_s": statistics.median(self.kernel[warm:]),
            "faults": statistics.median(self.faults[warm:]),
            "state_bytes": _state_bytes(self.model, self.opt),
            "model_bytes": self.model_bytes,
            "comm_bytes": self.comm[-1],  # the second step's (the first one's holds the one-time agreement check)
            "ag_wait_s": statistics.median(self.waits[warm:]),
        }


def _warm(steps: int) -> int:
    """Steps left out of the medians: a quarter, at least 2, but never all of them (``--steps 2`` keeps one)."""
    return min(max(2, steps // 4), steps - 1)


def _bench_one(rank: int, world: int, name: str, cfg: GPTConfig, steps: int, batch: int) -> dict[str, Any]:
    runner = Runner(name, cfg)
    for step in range(steps):
        runner.step(rank, world, batch, seed=step)
    return runner.result(_warm(steps))


PIN_ENV = "BENCH_PIN_RANKS"  # set by --pin_ranks before the ranks start


def _pin_if_asked(rank: int) -> None:
    """With --pin_ranks: this rank and every thread it starts (gloo's) run on CPU ``rank`` only."""
    if os.environ.get(PIN_ENV) == "1":
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def _bench_interleaved(rank: int, world: int, names: list[str], cfg: GPTConfig, steps: int, batch: int) -> dict:
    """Every system built side by side on each rank; each step runs all of them on the same batch, in an order
    reversed on every other step, so a drift of the machine's speed falls on all of them alike."""
    _pin_if_asked(rank)
    torch.set_num_threads(1)
    runners = [Runner(name, cfg) for name in names]
    for step in range(steps):
        for runner in runners if step % 2 == 0 else runners[::-1]:
            runner.step(rank, world, batch, seed=step)
    return {runner.name: runner.result(_warm(steps)) for runner in runners}


def _bench_all(
    rank: int,
    world: int,
    names: list[str],
    cfg: GPTConfig,
    steps: int,
    batch: int,
    direct_min_mb: float | None,
    passes: int = 1,
) -> dict[str, Any]:
    """Every system ``passes`` times, the order reversed on every other pass; step times pooled per system."""
    _pin_if_asked(rank)
    torch.set_num_threads(1)
    if direct_min_mb is not None:
        from fullshard.engine import group

        group.DIRECT_MIN_BYTES = int(direct_min_mb * 2**20)
    results: dict[str, Any] = {}
    for p in range(passes):
        for name in names if p % 2 == 0 else names[::-1]:
            result = _bench_one(rank, world, name, cfg, steps, batch)
            if name in results:
                result["times"] += results[name]["times"]
                result["step_s"] = statistics.median(result["times"])
            results[name] = result
    return results


TRACE_WARMUP, TRACE_STEPS = 2, 3
STEP_LABEL, OPTIMIZER_LABEL = "bench::step", "optimizer"
# Leaf ranges: none nests inside another, so their times add up (see fullshard/engine/trace.py).
BREAKDOWN = {
    "exposed AG wait": (trace.ALL_GATHER_WAIT,),
    "exposed reduce wait": (trace.REDUCE_WAIT,),
    "copies": (trace.COPY_OUT, trace.COPY_IN),
    "optimizer": (OPTIMIZER_LABEL,),
}


def _trace_one(rank: int, world: int, name: str, cfg: GPTConfig, batch: int, out_dir: str) -> dict[str, float]:
    """Profile TRACE_STEPS steps of ``name``; export this rank's Chrome trace; return ms per step by part."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = system(name).build(TinyGPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per = batch // world

    def step(i: int) -> None:
        x, y = make_batch(cfg, batch, seed=i)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        dist.barrier()
        with record_function(STEP_LABEL):
            model(x, y).backward()
            with record_function(OPTIMIZER_LABEL):
                opt.step()
                opt.zero_grad(set_to_none=False)

    for i in range(TRACE_WARMUP):
        step(i)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(TRACE_WARMUP, TRACE_WARMUP + TRACE_STEPS):
            step(i)
    prof.export_chrome_trace(os.path.join(out_dir, f"trace_rank{rank}.json"))
    totals_us = {e.key: e.cpu_time_total for e in prof.key_averages()}
    if totals_us.get(STEP_LABEL, 0) == 0:
        raise RuntimeError(f"the profile holds no {STEP_LABEL!r} range; the breakdown cannot be computed")
    parts = {part: sum(totals_us.get(k, 0.0) for k in keys) / 1e3 / TRACE_STEPS for part, keys in BREAKDOWN.items()}
    total = totals_us[STEP_LABEL] / 1e3 / TRACE_STEPS
    return {"step": total, "compute": total - sum(parts.values()), **parts}


def trace_steps(name: str, cfg: GPTConfig, batch: int, out_dir: str) -> None:
    if name not in SYSTEMS or not SYSTEMS[name].ours:
        ours = [n for n, s in SYSTEMS.items() if s.ours]
        raise SystemExit(f"--trace profiles one fullshard system; got {name!r}. Pass --systems with one of {ours}.")
    os.makedirs(out_dir, exist_ok=True)
    rows = on_fresh_ranks(_trace_one, name, cfg, batch, out_dir, world=WORLD)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{name}: ms per step, mean of {TRACE_STEPS} profiled steps, {WORLD} gloo CPU ranks")
    columns = ("step", "compute", *BREAKDOWN)
    for col in ("rank", *columns):
        table.add_column(col, justify="right")
    for rank, row in enumerate(rows):
        table.add_row(str(rank), *(f"{row[c]:.1f}" for c in columns))
    console = Console(width=160)
    console.print(table)
    console.print(f"Chrome traces: {', '.join(os.path.join(out_dir, f'trace_rank{r}.json') for r in range(WORLD))}")


def _paired_ratios(results: list[dict[str, Any]], name: str, reference: str) -> list[float]:
    """Per timed step of an interleaved run, ``name``'s step over ``reference``'s (the slowest rank's each)."""
    pace = [max(times) for times in zip(*(r[name]["times"] for r in results))]
    ref = [max(times) for times in zip(*(r[reference]["times"] for r in results))]
    return [a / b for a, b in zip(pace, ref)]


def _ratio(results: list[dict[str, Any]], name: str, reference: str, paired: bool) -> float:
    """``name``'s step time over ``reference``'s: the slowest rank sets each one's pace. Paired (interleaved
    runs): the median over steps of the ratio within each step; otherwise the ratio of the medians."""
    if not paired:
        return max(r[name]["step_s"] for r in results) / max(r[reference]["step_s"] for r in results)
    return statistics.median(_paired_ratios(results, name, reference))


def _paired_summary(results: list[dict[str, Any]], name: str, reference: str) -> str:
    """``name``'s paired step ratio to ``reference``'s, its 95% interval beside it where one exists."""
    ratios = _paired_ratios(results, name, reference)
    interval = median_interval(ratios)
    spread = f" (95% interval of the median {interval[0]:.3f}-{interval[1]:.3f})" if interval else ""
    return f"{statistics.median(ratios):.3f}x{spread}"


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median: the order statistics ``j`` and ``n + 1 - j``
    (1-based), the narrowest pair that the binomial(n, 1/2) law of "values below the median" gives at least
    ``level`` coverage: ``P(j <= B <= n - j)``. No assumption on the noise's shape, only that the steps' ratios
    are independent draws. None where no pair reaches ``level`` (fewer than 6 values at 95%)."""
    n = len(values)
    pmf = [math.comb(n, i) / 2**n for i in range(n + 1)]
    ordered = sorted(values)
    for j in range(n // 2, 0, -1):
        if sum(pmf[j : n - j + 1]) >= level:
            return ordered[j - 1], ordered[n - j]
    return None


def report_steps(results: list[dict[str, Any]], names: list[str], paired: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    how = "interleaved step by step, ratios paired per step" if paired else "ratios of medians"
    table = Table(title=f"{WORLD} gloo CPU ranks; medians ({how}); bytes, CPU time and page faults per rank")
    columns = ("system", "step ms", "vs FSDP2", "vs DDP", "CPU ms", "kernel ms", "faults", "state MB")
    columns += ("state / (model-state/N)",)
    for col in (*columns, "comm MB/step", "theory MB", "AG wait ms"):
        table.add_column(col, justify="right")
    ddp_name = DDP
    for name in names:
        step = max(r[name]["step_s"] for r in results)  # the slowest rank sets the pace
        state = max(r[name]["state_bytes"] for r in results)
        model_bytes = results[0][name]["model_bytes"]
        chosen = system(name)
        strategy = chosen.strategy
        shards = 1 if strategy == "NO_SHARD" else WORLD
        ideal = 4 * model_bytes / shards  # params + grads + Adam's two moments, fp32
        comm = max(r[name]["comm_bytes"] for r in results)
        compute_bytes = model_bytes / 2 if chosen.bf16 else model_bytes
        theory = THEORY_FACTOR[strategy] * compute_bytes * (WORLD - 1) / WORLD
        reference = chosen.baseline
        wait = max(r[name]["ag_wait_s"] for r in results) if chosen.ours else None
        table.add_row(
            name,
            f"{step * 1e3:.1f}",
            f"{_ratio(results, name, reference, paired):.2f}" if reference in names else "-",
            f"{_ratio(results, name, ddp_name, paired):.2f}" if ddp_name in names and not chosen.bf16 else "-",
            f"{max(r[name]['cpu_s'] for r in results) * 1e3:.0f}",
            f"{max(r[name]['kernel_s'] for r in results) * 1e3:.0f}",
            f"{max(r[name]['faults'] for r in results):.0f}",
            f"{state / 1e6:.2f}",
            f"{state / ideal:.3f}",
            f"{comm / 1e6:.2f}",
            f"{theory / 1e6:.2f}",
            f"{wait * 1e3:.1f}" if wait is not None else "-",
        )
    console = Console(width=200)
    console.print(table)
    console.print("bf16 rows are compared with torch FSDP2 bf16 (and not with DDP, in fp32); the others in fp32.")
    cores = len(os.sched_getaffinity(0))
    if ddp_name in names:
        # All ranks share ``cores`` CPUs, so no schedule runs a step in less than their CPU time over the cores.
        ddp_step = max(r[ddp_name]["step_s"] for r in results)
        for name in names:
            if not system(name).bf16:
                floor = sum(r[name]["cpu_s"] for r in results) / cores
                console.print(
                    f"{name}: CPU time of the {WORLD} ranks over {cores} cores = {floor * 1e3:.0f} ms "
                    f"per step, {floor / ddp_step:.2f}x DDP's step (no overlap can go below it)"
                )
    for name in names:
        native = name + GLOO_NATIVE
        if native in names:
            ratio = max(r[name]["step_s"] for r in results) / max(r[native]["step_s"] for r in results)
            console.print(f"{name}: step time with the engine's collective choice / gloo's collectives: {ratio:.2f}")
    if paired:  # the table's ratios to three places, with how far the noise leaves their medians
        for name in names:
            for reference in dict.fromkeys((system(name).baseline, ddp_name)):
                if reference in names and reference != name and (reference != ddp_name or not system(name).bf16):
                    console.print(f"{name}: {_paired_summary(results, name, reference)} {reference}'s step")
    for name in names:
        unchecked = name + UNCHECKED
        if unchecked in names:
            if paired:
                summary = _paired_summary(results, name, unchecked)
            else:
                summary = f"{_ratio(results, name, unchecked, paired):.3f}"
            console.print(f"{name}: step time with the in-step check / without it: {summary}")
    on_demand, prefetched = OURS_FSDP_BF16_ON_DEMAND, OURS_FSDP_BF16_PREFETCH_ALL
    if on_demand in names and prefetched in names:
        exposed = max(r[on_demand]["ag_wait_s"] for r in results)
        left = max(r[prefetched]["ag_wait_s"] for r in results)
        if exposed > 0:
            console.print(f"all-gather time hidden behind compute by prefetching: {1 - left / exposed:.0%}")


def steps_main(args: argparse.Namespace) -> None:
    os.environ[PIN_ENV] = "1" if args.pin_ranks else "0"
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.width)
    if args.trace is not None:
        chosen = args.systems if args.systems != list(SYSTEMS) else [TRACE_DEFAULT]
        if len(chosen) != 1:
            raise SystemExit(f"--trace profiles one system at a time; got {len(chosen)}: {chosen}")
        trace_steps(chosen[0], cfg, args.batch, args.trace)
        return
    for name in args.systems:
        system(name)  # an unknown name fails here, before any rank starts
    # A medium model with several passes outlasts the default timeouts on a busy machine (gloo too: pg timeout).
    if args.interleave:
        if args.passes != 1 or args.direct_min_mb is not None:
            raise SystemExit("--interleave runs one pass with the engine's layout: drop --passes/--direct_min_mb")
        results = on_fresh_ranks(_bench_interleaved, args.systems, cfg, args.steps, args.batch, timeout_s=3 * 3600)
    else:
        results = on_fresh_ranks(
            _bench_all, args.systems, cfg, args.steps, args.batch, args.direct_min_mb, args.passes, timeout_s=3 * 3600
        )
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report_steps(results, args.systems, paired=args.interleave)


def steps_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--systems", nargs="*", default=list(SYSTEMS))
    p.add_argument("--passes", type=int, default=1, help="run the systems this many times, interleaved")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="build every system side by side and alternate them step by step (ratios paired per step)",
    )
    p.add_argument(
        "--direct_min_mb",
        type=float,
        default=None,
        help="gathered size from which fullshard gathers a parameter on its own (default: the engine's)",
    )
    p.add_argument(
        "--trace",
        metavar="DIR",
        default=None,
        help="profile one fullshard system (--systems, default FULL_SHARD): Chrome traces and a breakdown",
    )
    p.add_argument(
        "--pin_ranks", action="store_true", help="run each rank (and its gloo threads) on one CPU of its own"
    )


# ==== layout =================================================================================================


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


def _layout_rank(rank: int, world: int, width: int, repeats: int) -> dict[str, float]:
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


def layout_main(args: argparse.Namespace) -> None:
    results = on_fresh_ranks(_layout_rank, args.width, args.repeats, world=WORLD)
    per_param = max(r["per_param"] for r in results)
    flat = max(r["flat"] for r in results)
    print(f"unit of {len(block_shapes(args.width))} parameters, {results[0]['bytes'] / 1e6:.2f} MB gathered")
    print(f"per-parameter all-gathers: {per_param:.2f} ms")
    print(f"flat all-gather + copy-out: {flat:.2f} ms")
    print(f"ratio per-parameter / flat: {per_param / flat:.2f}")


def layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--repeats", type=int, default=30)

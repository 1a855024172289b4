"""Training benchmarks: a GPT on 2 gloo CPU ranks under fullshard and its peers, one mode per question.

    python benchmarks/train.py steps [--steps 12] [--layers 4] [--width 256] [--systems NAME ...]
        [--passes N | --interleave] [--pin_ranks] [--direct_min_mb MB] [--trace DIR]
    python benchmarks/train.py memory [--quick] [--layers 16 --width 2048 --heads 16 --vocab 8192] [--steps 3]
        [--systems NAME ...] [--accumulate K] [--no-ddp] [--ddp_cap_gib G] [--cap_all] [--inflight N] [--out F]
    python benchmarks/train.py layout [--width 256] [--repeats 30]
    python benchmarks/train.py peak [--layers 4 --width 512] [--world 1 2 4] [--strategies ...] [--ac] [--out F]
    python benchmarks/train.py peak --compare F.json [...]

Every mode first prints the machine (``fullshard.testing.bench.describe_machine``). The systems are those of
``benchmarks/kit.py`` (``--systems`` takes their names; ``memory`` also the short "fullshard FSDP" and "torch
FSDP2", then " +AC" and/or " sharded accumulation").

``steps``: speed. Per system, the median step time of the slowest rank and its ratio to torch FSDP2 (bf16 rows:
to torch FSDP2 bf16) and to DDP; CPU time per step and rank (every thread), the part in the kernel (on loopback
TCP mostly the collectives' bytes copied through sockets), minor page faults; the bytes each rank holds in
parameters + gradients + optimizer states (and that over model-state bytes / N); the bytes moved through
collectives per step (counted by a dispatch mode on the c10d ops; point-to-point sends as sent) beside the
theoretical figure (FULL_SHARD 3 x model bytes x (N-1)/N, SHARD_GRAD_OP and NO_SHARD/DDP 2 x); the exposed
all-gather wait. Under the table, each system's CPU floor (CPU time of all ranks per step over the cores they
share, as a ratio to DDP's step). ``--passes N`` runs the systems N times in alternating order, pooled;
``--interleave`` builds all of them side by side and alternates step by step (ratios paired per step);
``--pin_ranks`` runs rank r (and its gloo threads) on CPU r only. ``--trace DIR`` profiles one fullshard system
instead: ``DIR/trace_rank<r>.json`` (Chrome trace) and a per-step breakdown from the engine's ``fullshard::``
profiler ranges (exposed all-gather and reduce waits, copies, optimizer, compute).

``memory``: peak memory at scale (default: the issue's 840M GPT, 16 layers x 2048, vocabulary 8192, sequence
128, local batch 1). Each system runs in fresh ranks from the same weights on the same data and prints a row:
median step time after the first, peak RSS per rank (``VmHWM``, reset once the model is wrapped), the floor
(16 Psi / N + 2 x the largest unit gathered + the activations autograd saves) and the losses, which must agree;
then each fullshard system against torch FSDP2 with the same checkpointing / accumulation, and whether DDP fits
under a per-rank address-space cap (``RLIMIT_AS``, default half the machine per rank). ``--accumulate K``
compares ``no_sync`` with sharded accumulation. Results (with an RSS timeline by phase, for ``plot.py``) go to
``--out`` and per-rank peaks are merged into ``--peaks`` (``estimate-memory``'s calibration).

``layout``: one flat all-gather per unit against one per parameter, for one block's parameters: median ms of
each and their ratio.

``peak``: peak RSS per rank of a few FSDP steps (meta init, unit by unit) for each world size and strategy,
beside ``estimate-memory``'s prediction and the error; ``--compare`` measures nothing and prints saved rows
(this mode's or ``memory``'s peaks.json) beside today's estimate.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from kit import AC_SUFFIX, GLOO_NATIVE, SYSTEMS, UNCHECKED, System, system
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fullshard.engine import trace
from fullshard.engine.api import ShardingStrategy
from fullshard.engine.collectives import COMM_STATS
from fullshard.frontend.estimate import estimate_training
from fullshard.testing.bench import (
    RssSampler,
    activation_bytes,
    label_phases,
    machine,
    on_fresh_ranks,
    peak_rss_bytes,
    peak_rss_of_training,
    reset_peak_rss,
    rss_bytes,
    run_mode,
)
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch

WORLD = 2
GiB = GIB = 2**30


# ==== steps: speed ==========================================================================================


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes this rank moves through c10d collectives, as ring algorithms move them."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.bytes = 0.0

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
        with self.system.environment():
            dist.barrier()
            counter = CollectiveBytes(world)
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
            "comm_bytes": statistics.median(self.comm[warm:]),
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
    if name not in SYSTEMS or not name.startswith("fullshard"):
        ours = [n for n in SYSTEMS if n.startswith("fullshard")]
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


def _ratio(results: list[dict[str, Any]], name: str, reference: str, paired: bool) -> float:
    """``name``'s step time over ``reference``'s: the slowest rank sets each one's pace. Paired (interleaved
    runs): the median over steps of the ratio within each step; otherwise the ratio of the medians."""
    if not paired:
        return max(r[name]["step_s"] for r in results) / max(r[reference]["step_s"] for r in results)
    pace = [max(times) for times in zip(*(r[name]["times"] for r in results))]
    ref = [max(times) for times in zip(*(r[reference]["times"] for r in results))]
    return statistics.median(a / b for a, b in zip(pace, ref))


def report_steps(results: list[dict[str, Any]], names: list[str], paired: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    baseline = "torch FSDP2 fully_shard"
    how = "interleaved step by step, ratios paired per step" if paired else "ratios of medians"
    table = Table(title=f"{WORLD} gloo CPU ranks; medians ({how}); bytes, CPU time and page faults per rank")
    columns = ("system", "step ms", "vs FSDP2", "vs DDP", "CPU ms", "kernel ms", "faults", "state MB")
    columns += ("state / (model-state/N)",)
    for col in (*columns, "comm MB/step", "theory MB", "AG wait ms"):
        table.add_column(col, justify="right")
    ddp_name = "torch DDP"
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
        reference = "torch FSDP2 bf16" if chosen.bf16 else baseline
        wait = max(r[name]["ag_wait_s"] for r in results) if name.startswith("fullshard") else None
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
    for name in names:
        unchecked = name + UNCHECKED
        if unchecked in names:
            ratio = _ratio(results, name, unchecked, paired)
            console.print(f"{name}: step time with the in-step check / without it: {ratio:.3f}")
    on_demand, prefetched = "fullshard FSDP bf16, no prefetch", "fullshard FSDP bf16, fwd+bwd prefetch"
    if on_demand in names and prefetched in names:
        exposed = max(r[on_demand]["ag_wait_s"] for r in results)
        left = max(r[prefetched]["ag_wait_s"] for r in results)
        if exposed > 0:
            console.print(f"all-gather time hidden behind compute by prefetching: {1 - left / exposed:.0%}")


# ==== memory: peak RSS at scale ==============================================================================


MAIN_SYSTEMS = [
    f"{w}{ac}" for w in ("fullshard FSDP", "fullshard fully_shard", "torch FSDP2") for ac in ("", AC_SUFFIX)
]
SHARDED_ACC = " sharded accumulation"


def parse_memory_system(name: str) -> tuple[System, bool]:
    """(the system, sharded accumulation) from a name such as "torch FSDP2 +AC" or "fullshard FSDP sharded
    accumulation": a name of ``kit.SYSTEMS`` (or a short one, "fullshard FSDP", "torch FSDP2"), then " +AC"
    and/or " sharded accumulation"."""
    sharded_acc = SHARDED_ACC in name
    base = name.replace(SHARDED_ACC, "")
    try:
        return system(base.replace(AC_SUFFIX, "") + (AC_SUFFIX if AC_SUFFIX in base else "")), sharded_acc
    except ValueError as err:
        raise SystemExit(f"{err}; then{SHARDED_ACC!r} if wanted") from None


# --- one system on one rank ------------------------------------------------------------------------------


def _memory_rank(
    rank: int,
    world: int,
    name: str,
    cfg: GPTConfig,
    steps: int,
    batch: int,
    accumulate: int,
    as_limit: int | None,
    inflight: int | None = None,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    if inflight is not None:
        from fullshard.engine import state

        state.MAX_REDUCTIONS_IN_FLIGHT = inflight
    if as_limit is not None:
        resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))
    chosen, sharded_acc = parse_memory_system(name)
    gc.collect()
    baseline = rss_bytes()
    phase = "build"
    try:
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        sampler = RssSampler()
        label_phases(model, list(model.blocks), sampler)
        phase = "wrap"
        model = chosen.build(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gc.collect()
        after_wrap = rss_bytes()
        dist.barrier()
        reset_peak_rss()
        times, losses, peaks = [], [], []
        phase = "train"
        with sampler:
            for step in range(steps):
                dist.barrier()
                sampler.set_phase(f"step {step} start")
                start = time.perf_counter()
                total = 0.0
                for micro in range(accumulate):
                    x, y = make_batch(cfg, batch * world, seed=step * accumulate + micro)
                    x, y = x[rank * batch : (rank + 1) * batch], y[rank * batch : (rank + 1) * batch]
                    last = micro == accumulate - 1
                    ctx = contextlib.nullcontext() if last or sharded_acc else chosen.no_sync(model)
                    with ctx:
                        loss = model(x, y) / accumulate
                        loss.backward()
                    total += loss.item()
                sampler.set_phase("optimizer step")
                opt.step()
                sampler.set_phase("zero_grad")
                opt.zero_grad()
                sampler.set_phase(f"step {step} end")
                times.append(time.perf_counter() - start)
                losses.append(total)
                peaks.append(peak_rss_bytes())
        samples = sampler.samples
    except (MemoryError, RuntimeError) as err:
        if as_limit is None or ("alloc" not in str(err).lower() and not isinstance(err, MemoryError)):
            raise
        return {"fits": False, "phase": phase, "error": str(err).splitlines()[0][:200], "baseline": baseline}
    return {
        "fits": True,
        "baseline": baseline,
        "after_wrap": after_wrap,
        "step_s": times,
        "losses": losses,
        "peak_per_step": peaks,
        "peak": peaks[-1],
        "timeline": _thin(samples, 4000),
    }


def _thin(samples: list[tuple[float, int, str]], keep: int) -> list[tuple[float, int, str]]:
    """At most ``keep`` samples, always keeping phase changes and each window's largest RSS."""
    if len(samples) <= keep:
        return samples
    window = len(samples) // keep + 1
    out = []
    for i in range(0, len(samples), window):
        chunk = samples[i : i + window]
        # The first sample of each phase marks where it starts; the window's largest keeps the peak.
        out.extend(s for j, s in enumerate(chunk) if i + j == 0 or s[2] != samples[i + j - 1][2])
        out.append(max(chunk, key=lambda s: s[1]))
    return sorted(set(out))


def run_system(
    name: str,
    cfg: GPTConfig,
    steps: int,
    batch: int,
    accumulate: int,
    as_limit: int | None = None,
    inflight: int | None = None,
) -> list[dict[str, Any]]:
    """``name`` on WORLD fresh ranks (a fresh allocator each time)."""
    return on_fresh_ranks(
        _memory_rank, name, cfg, steps, batch, accumulate, as_limit, inflight, world=WORLD, timeout_s=7200, grace_s=900
    )


# --- the floor -------------------------------------------------------------------------------------------


def floor_parts(cfg: GPTConfig, batch: int, ac: bool, accumulate_unsharded: bool = False) -> dict[str, int]:
    """Bytes per rank that any fully sharded fp32 AdamW run of ``cfg`` must hold at its peak."""
    torch.manual_seed(0)
    block = Block(cfg)
    unit = 4 * sum(p.numel() for p in block.parameters())
    x = torch.randn(batch, cfg.block_size, cfg.n_embd, requires_grad=True)
    per_block = activation_bytes(block, x)
    del block
    psi = param_count(cfg)
    logits = 4 * batch * cfg.block_size * cfg.vocab_size * 3  # logits, their softmax and its gradient
    block_input = 4 * batch * cfg.block_size * cfg.n_embd
    activations = (cfg.n_layer * block_input + per_block if ac else cfg.n_layer * per_block) + logits
    parts = {"state": 16 * psi // WORLD, "gathered": 2 * unit, "activations": activations}
    if accumulate_unsharded:
        parts["unsharded grads"] = 4 * psi - 4 * psi // WORLD  # full-size gradients kept across micro-batches
    return parts


def param_count(cfg: GPTConfig) -> int:
    c, v = cfg.n_embd, cfg.vocab_size
    block = 3 * c * c + (c * c + c) + (c * (4 * c + 1) + 4 * c + 1) + ((4 * c + 1) * c + c) + 4 * c
    return cfg.n_layer * block + v * c + cfg.block_size * c + 2 * c + v * c + 1


# --- DDP under a cap -------------------------------------------------------------------------------------


def try_ddp(cfg: GPTConfig, batch: int, as_limit: int) -> dict[str, Any]:
    try:
        rows = run_system("torch DDP", cfg, 2, batch, 1, as_limit=as_limit)
    except Exception as err:  # a rank killed by the cap, or a failure in a collective after a peer failed
        return {"fits": False, "error": f"{type(err).__name__}: {str(err)[-300:]}"}
    if all(r["fits"] for r in rows):
        return {"fits": True, "peak": max(r["peak"] for r in rows)}
    failed = next(r for r in rows if not r["fits"])
    return {"fits": False, "error": f"in {failed['phase']}: {failed['error']}"}


def memory_main(args: argparse.Namespace) -> None:
    args.commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    ).stdout.strip()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by the spawned ranks: frees show in RSS
    if args.quick:
        args.layers, args.width, args.heads, args.vocab = 2, 256, 4, 1024
    cfg = GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width
    )
    if args.accumulate > 1:
        default = [
            f"{w}{s}"
            for w in ("fullshard FSDP", "fullshard fully_shard", "torch FSDP2")
            for s in ("", " sharded accumulation")
        ]
    else:
        default = MAIN_SYSTEMS
    systems = args.systems or default
    for name in systems:
        parse_memory_system(name)
    psi = param_count(cfg)
    info = machine()
    print(
        f"model: {cfg} = {psi / 1e6:.0f}M parameters, {16 * psi / 1e9:.1f} GB fp32 state with AdamW; "
        f"{WORLD} gloo ranks, local batch {args.batch}, accumulate {args.accumulate}"
    )
    print(f"machine: {info}")
    results: dict[str, Any] = {
        "config": cfg.__dict__,
        "params": psi,
        "world": WORLD,
        "batch": args.batch,
        "accumulate": args.accumulate,
        "machine": info,
        "inflight": args.inflight,
        "systems": {},
    }
    cap = int((args.ddp_cap_gib * GiB) if args.ddp_cap_gib else _mem_total() / WORLD)
    for name in systems:
        start_load = os.getloadavg()[0]
        rows = run_system(
            name,
            cfg,
            args.steps,
            args.batch,
            args.accumulate,
            as_limit=cap if args.cap_all else None,
            inflight=args.inflight,
        )
        if not all(r["fits"] for r in rows):
            print(f"{name}: does not fit under RLIMIT_AS={cap / GiB:.1f} GiB: {[r.get('error') for r in rows]}")
            continue
        chosen, sharded_acc = parse_memory_system(name)
        unsharded = args.accumulate > 1 and not sharded_acc
        floor = floor_parts(cfg, args.batch, chosen.checkpointed, unsharded)
        results["systems"][name] = {"ranks": rows, "floor": floor, "load": [start_load, os.getloadavg()[0]]}
        _print_row(name, rows, floor, start_load)
        _save(args.out, results)
        _record_peaks(args.peaks, cfg, name, rows, floor, args)
    if args.ddp and args.accumulate == 1:
        outcome = try_ddp(cfg, args.batch, cap)
        outcome["cap_bytes"] = cap
        outcome["needs_bytes"] = 16 * psi
        results["ddp"] = outcome
        print(
            f"torch DDP under RLIMIT_AS={cap / GiB:.1f} GiB per rank (needs {16 * psi / GiB:.1f} GiB of state "
            f"per rank, {WORLD * 16 * psi / GiB:.1f} GiB for {WORLD}): "
            + ("fits" if outcome["fits"] else f"does not fit ({outcome['error']})")
        )
        _save(args.out, results)
    _summary(results)


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def _print_row(name: str, rows: list[dict[str, Any]], floor: dict[str, int], load: float) -> None:
    peak = max(r["peak"] for r in rows)
    step = statistics.median(max(r["step_s"][i] for r in rows) for i in range(1, len(rows[0]["step_s"])))
    total = sum(floor.values())
    print(
        f"{name:42s} step {step:7.2f} s  peak/rank {peak / GiB:6.2f} GiB  floor {total / GiB:5.2f} GiB "
        f"(x{peak / total:.2f}; +{rows[0]['baseline'] / GiB:.2f} interpreter)  "
        f"losses {[round(v, 4) for v in rows[0]['losses']]}  load {load:.1f}",
        flush=True,
    )


def _summary(results: dict[str, Any]) -> None:
    systems = results["systems"]
    bases = [n for n in systems if n.startswith("torch FSDP2")]
    if not bases:
        return
    print("\nagainst torch FSDP2 with the same activation checkpointing / accumulation mode:")
    for name, res in systems.items():
        twin = name.replace("fullshard FSDP", "torch FSDP2").replace("fullshard fully_shard", "torch FSDP2")
        if twin not in systems or twin == name:
            continue
        ours, theirs = res["ranks"], systems[twin]["ranks"]
        step = _median_step(ours) / _median_step(theirs)
        peak = max(r["peak"] for r in ours) / max(r["peak"] for r in theirs)
        loss_gap = max(abs(a - b) for a, b in zip(ours[0]["losses"], theirs[0]["losses"]))
        print(f"  {name:42s} step time x{step:.2f}  peak RSS x{peak:.3f}  max loss difference {loss_gap:.2e}")


def _median_step(rows: list[dict[str, Any]]) -> float:
    return statistics.median(max(r["step_s"][i] for r in rows) for i in range(1, len(rows[0]["step_s"])))


def _save(path: str, results: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(path + ".tmp", path)


def _record_peaks(
    path: str, cfg: GPTConfig, name: str, rows: list[dict[str, Any]], floor: dict[str, int], args: argparse.Namespace
) -> None:
    """Merge this system's per-rank peaks into ``path`` (one entry per configuration, newest wins)."""
    chosen, sharded_acc = parse_memory_system(name)
    base = chosen.name.removesuffix(AC_SUFFIX)
    entry = {
        "model_config": {**cfg.__dict__, "params": param_count(cfg), "local_batch": args.batch},
        "entry_point": {
            "fullshard FSDP": "FullyShardedDataParallel",
            "fullshard FSDP FULL_SHARD": "FullyShardedDataParallel",
            "fullshard fully_shard": "fully_shard",
            "torch FSDP2": "torch.distributed.fsdp.fully_shard",
            "torch FSDP2 fully_shard": "torch.distributed.fsdp.fully_shard",
        }.get(base, base),
        "system": name,
        "strategy": "FULL_SHARD",
        "world_size": WORLD,
        "activation_checkpointing": chosen.checkpointed,
        "accumulate": args.accumulate,
        "sharded_accumulation": sharded_acc,
        "peak_rss_bytes": max(r["peak"] for r in rows),
        "peak_rss_bytes_per_rank": [r["peak"] for r in rows],
        "interpreter_rss_bytes": max(r["baseline"] for r in rows),
        "floor_bytes": sum(floor.values()),
        "floor_parts": floor,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "commit": args.commit,  # the worktree's HEAD when the run started (uncommitted edits not included)
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    entries = []
    if os.path.exists(path):
        with open(path) as f:
            entries = json.load(f)
    key = ("model_config", "system", "world_size", "accumulate")
    entries = [e for e in entries if tuple(e.get(k) for k in key) != tuple(entry[k] for k in key)]
    entries.append(entry)
    with open(path + ".tmp", "w") as f:
        json.dump(entries, f, indent=1)
    os.replace(path + ".tmp", path)


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


# ==== peak: against estimate-memory ==========================================================================


def _config_of(row: dict) -> tuple[GPTConfig, int, int, str, bool]:
    """(config, batch, world, strategy, AC) of a row of ``train.py peak`` or of ``train.py memory``'s peaks.json."""
    if "model_config" in row:  # train.py memory's peaks.json
        c = row["model_config"]
        cfg = GPTConfig(vocab_size=c["vocab_size"], block_size=c["block_size"], n_layer=c["n_layer"],
                        n_head=c["n_head"], n_embd=c["n_embd"])  # fmt: skip
        return cfg, c["local_batch"], row["world_size"], row["strategy"], row["activation_checkpointing"]
    cfg = GPTConfig(vocab_size=row["vocab"], block_size=row["seq"], n_layer=row["layers"], n_head=row["heads"],
                    n_embd=row["width"])  # fmt: skip
    return cfg, row["batch"], row["world"], row["strategy"], row["activation_checkpointing"]


def compare(paths: list[Path]) -> None:
    """Measured peaks (JSON rows from here or from train.py memory) beside today's estimate."""
    header = f"{'model':>22} {'B':>2} {'N':>2} {'strategy':13} {'AC':>2} {'measured':>9} {'estimate':>9} {'error':>7}"
    print(header + "  source")
    for path in paths:
        for row in json.loads(path.read_text()):
            cfg, batch, world, strategy, ac = _config_of(row)
            with torch.device("meta"):
                model = TinyGPT(cfg)
            est = estimate_training(model, {Block}, world, ShardingStrategy[strategy], batch=batch,
                                    seq=cfg.block_size, checkpointing=ac)  # fmt: skip
            size = sum(p.numel() for p in model.parameters()) / 1e6
            name = f"{cfg.n_layer}x{cfg.n_embd} v{cfg.vocab_size} ({size:.0f}M)"
            peak = row.get("peak_bytes", row.get("peak_rss_bytes"))
            print(f"{name:>22} {batch:>2} {world:>2} {strategy:13} {'y' if ac else 'n':>2} {peak / GIB:9.3f} "
                  f"{est.peak / GIB:9.3f} {est.peak / peak - 1:+7.1%}  {path.name} {row.get('commit', '')}"
                  )  # fmt: skip


def peak_main(args: argparse.Namespace) -> None:
    if args.compare:
        compare(args.compare)
        return
    if not args.glibc_default:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # the spawned ranks inherit it
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.width)  # fmt: skip
    with torch.device("meta"):
        meta_model = TinyGPT(cfg)
    rows = []
    print(f"GPT {args.layers}x{args.width}, vocab {args.vocab}, {args.batch}x{args.seq} tokens/rank, "
          f"AC={args.ac}, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'N':>3} {'strategy':14} {'base GiB':>9} {'peak GiB':>9} {'estimate':>9} {'error':>7}")
    for world in args.world:
        for strategy in args.strategies:
            row = peak_rss_of_training(cfg, world, strategy, args.batch, args.steps, args.ac)
            est = estimate_training(meta_model, {Block}, world, ShardingStrategy[strategy], batch=args.batch,
                                    seq=args.seq, checkpointing=args.ac)  # fmt: skip
            row["estimate_bytes"] = est.peak
            row["estimate_phase"] = est.peak_phase
            rows.append(row)
            err = est.peak / row["peak_bytes"] - 1
            print(f"{world:>3} {strategy:14} {row['base_bytes'] / GIB:9.3f} {row['peak_bytes'] / GIB:9.3f} "
                  f"{est.peak / GIB:9.3f} {err:+7.1%}")  # fmt: skip
    if args.out:
        old = json.loads(args.out.read_text()) if args.out.exists() else []
        args.out.write_text(json.dumps(old + rows, indent=1))


def steps_main(args: argparse.Namespace) -> None:
    os.environ[PIN_ENV] = "1" if args.pin_ranks else "0"
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.width)
    if args.trace is not None:
        chosen = args.systems if args.systems != list(SYSTEMS) else ["fullshard FSDP FULL_SHARD"]
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


def _steps_args(p: argparse.ArgumentParser) -> None:
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


def _memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a ~2M model, to check the script in seconds")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="local batch per rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (no_sync before the last)")
    p.add_argument("--systems", nargs="*", default=None)
    p.add_argument(
        "--ddp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="attempt DDP under a per-rank address-space cap",
    )
    p.add_argument("--ddp_cap_gib", type=float, default=None, help="default: half the machine's memory")
    p.add_argument("--cap_all", action="store_true", help="run the sharded systems under the same address-space cap")
    p.add_argument(
        "--inflight", type=int, default=None, help="fullshard's MAX_REDUCTIONS_IN_FLIGHT (default: the engine's)"
    )
    p.add_argument("--out", default="/tmp/fullshard-bench/scale/bench_scale.json")
    p.add_argument("--peaks", default="/tmp/fullshard-bench/scale/peaks.json")


def _layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--repeats", type=int, default=30)


def _peak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="2: the second step runs with Adam's states")
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--strategies", nargs="+", default=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    p.add_argument("--ac", action="store_true", help="activation checkpointing of every block")
    p.add_argument("--glibc-default", action="store_true", help="leave MALLOC_MMAP_THRESHOLD_ unset")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        default=None,
        help="measure nothing: print these JSON files' peaks beside today's estimate",
    )


MODES = {
    "steps": (_steps_args, steps_main, "step time, CPU, traffic and state of each system (or --trace one)"),
    "memory": (_memory_args, memory_main, "peak RSS per rank at scale against the floor; DDP under a cap"),
    "layout": (_layout_args, layout_main, "one flat all-gather per unit against one per parameter"),
    "peak": (_peak_args, peak_main, "peak RSS per rank against estimate-memory's prediction"),
}


def main() -> None:
    run_mode(__doc__, MODES)


if __name__ == "__main__":
    main()

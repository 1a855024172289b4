"""Train a GPT that DDP cannot hold on this machine, under fullshard and torch's FSDP2, on 2 gloo ranks.

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/bench_scale.py
    python benchmarks/bench_scale.py --quick                   # a small model, to check the script
    python benchmarks/bench_scale.py --layers 4 --width 1024   # the size sweep (a row per size)
    python benchmarks/bench_scale.py --accumulate 4            # no_sync gradient accumulation memory

The default model is the issue's: 16 layers, width 2048, 16 heads, vocabulary 8192, sequence 128, local
batch 1: about 840M parameters, 13.4 GB of fp32 model state with AdamW (16 bytes per parameter).

Each system runs in fresh processes (so one's allocator state does not leak into the next one's peak),
trains ``--steps`` steps from the same initial weights on the same data, and reports per rank: the median
step time after the first (which allocates the optimizer state), the peak RSS over the training steps
(the kernel's ``VmHWM``, reset once the model is wrapped; model construction is not counted), an RSS
timeline labelled by phase, and the losses, which must agree across systems. The floor is
16 Psi / N + 2 x the largest unit gathered (its parameters and its unsharded gradient) + the activations
autograd keeps (measured with saved-tensor hooks on one block); the interpreter's RSS before the model is
built is shown beside it.

DDP of the same model is attempted in a child whose address space is capped (``RLIMIT_AS``, default half
the machine's memory per rank) and is reported as not fitting when it fails to allocate.

With ``--accumulate K`` each step is K micro-batches; the first K-1 run without gradient synchronisation
(``no_sync()`` / ``set_requires_gradient_sync(False)``) unless the system's name says "sharded
accumulation", which reduce-scatters every micro-batch into the sharded gradient (memory 1/N, K times the
reduce-scatter traffic).

Results go to ``--out`` (JSON, default /tmp/fullshard-bench/scale/bench_scale.json) for ``plot_scale.py``, and
per-rank peaks are merged into ``--peaks`` (default /tmp/fullshard-bench/scale/peaks.json).
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
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale_memory as mem

from fullshard import FullyShardedDataParallel as OurFSDP
from fullshard import fully_shard as our_fully_shard
from fullshard.algorithms.checkpointing import checkpoint_module
from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.wrap import ModuleWrapPolicy

WORLD = 2
GiB = 2**30


# --- systems: (wrap(model) -> model, no_sync(model) -> context manager) ---------------------------------


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, Block)]


def ours_fsdp(model: nn.Module) -> nn.Module:
    return OurFSDP(model, sharding_strategy="FULL_SHARD", auto_wrap_policy=ModuleWrapPolicy({Block}))


def ours_fully_shard(model: nn.Module) -> nn.Module:
    for block in model.blocks:
        our_fully_shard(block)
    return our_fully_shard(model)


def torch_fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True)
    return fully_shard(model, reshard_after_forward=True)


def ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


@contextlib.contextmanager
def _requires_sync_off(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


WRAPS: dict[str, tuple[Callable[[nn.Module], nn.Module], Callable[[nn.Module], Any]]] = {
    "fullshard FSDP": (ours_fsdp, lambda m: m.no_sync()),
    "fullshard fully_shard": (ours_fully_shard, _requires_sync_off),
    "torch FSDP2": (torch_fsdp2, _requires_sync_off),
    "torch DDP": (ddp, lambda m: m.no_sync()),
}
MAIN_SYSTEMS = [f"{w}{ac}" for w in ("fullshard FSDP", "fullshard fully_shard", "torch FSDP2") for ac in ("", " +AC")]


def parse_system(name: str) -> tuple[str, bool, bool]:
    """(wrapper, activation checkpointing, sharded accumulation) from a name such as "torch FSDP2 +AC"."""
    ac = " +AC" in name
    sharded_acc = " sharded accumulation" in name
    base = name.replace(" +AC", "").replace(" sharded accumulation", "")
    if base not in WRAPS:
        raise SystemExit(
            f"unknown system {name!r}: the base must be one of {list(WRAPS)}, then ' +AC' and/or "
            "' sharded accumulation'"
        )
    return base, ac, sharded_acc


# --- one system on one rank ------------------------------------------------------------------------------


def train_rank(
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
    base, ac, sharded_acc = parse_system(name)
    wrap, no_sync = WRAPS[base]
    gc.collect()
    baseline = mem.rss_bytes()
    phase = "build"
    try:
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        blocks = list(model.blocks)
        if ac:
            for block in blocks:
                checkpoint_module(block)
        sampler = mem.RssSampler()
        mem.label_phases(model, blocks, sampler)
        phase = "wrap"
        model = wrap(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gc.collect()
        after_wrap = mem.rss_bytes()
        dist.barrier()
        mem.reset_peak()
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
                    ctx = contextlib.nullcontext() if last or sharded_acc else no_sync(model)
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
                peaks.append(mem.peak_rss_bytes())
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
    pool = WorkerPool(WORLD, timeout_s=7200.0, grace_s=900.0)
    try:
        return pool.run(train_rank, name, cfg, steps, batch, accumulate, as_limit, inflight)
    finally:
        pool.close()


# --- the floor -------------------------------------------------------------------------------------------


def floor_parts(cfg: GPTConfig, batch: int, ac: bool, accumulate_unsharded: bool = False) -> dict[str, int]:
    """Bytes per rank that any fully sharded fp32 AdamW run of ``cfg`` must hold at its peak."""
    torch.manual_seed(0)
    block = Block(cfg)
    unit = 4 * sum(p.numel() for p in block.parameters())
    x = torch.randn(batch, cfg.block_size, cfg.n_embd, requires_grad=True)
    per_block = mem.activation_bytes(block, x)
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


# --- main ------------------------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "?")
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f" {f}" in flags]
    return {
        "cpu": model,
        "flags": " ".join(have),
        "load": os.getloadavg().__repr__(),
        "torch": torch.__version__,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "default"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ~10M model, to check the script in seconds")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="local batch per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (no_sync before the last)")
    parser.add_argument("--systems", nargs="*", default=None)
    parser.add_argument(
        "--ddp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="attempt DDP under a per-rank address-space cap",
    )
    parser.add_argument("--ddp_cap_gib", type=float, default=None, help="default: half the machine's memory")
    parser.add_argument(
        "--cap_all", action="store_true", help="run the sharded systems under the same address-space cap as DDP"
    )
    parser.add_argument(
        "--inflight",
        type=int,
        default=None,
        help="fullshard's MAX_REDUCTIONS_IN_FLIGHT for this run (default: the engine's)",
    )
    parser.add_argument("--out", default="/tmp/fullshard-bench/scale/bench_scale.json")
    parser.add_argument("--peaks", default="/tmp/fullshard-bench/scale/peaks.json")
    args = parser.parse_args()
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
        parse_system(name)
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
        _, ac, sharded_acc = parse_system(name)
        unsharded = args.accumulate > 1 and not sharded_acc
        floor = floor_parts(cfg, args.batch, ac, unsharded)
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
    base, ac, sharded_acc = parse_system(name)
    entry = {
        "model_config": {**cfg.__dict__, "params": param_count(cfg), "local_batch": args.batch},
        "entry_point": {
            "fullshard FSDP": "FullyShardedDataParallel",
            "fullshard fully_shard": "fully_shard",
            "torch FSDP2": "torch.distributed.fsdp.fully_shard",
        }.get(base, base),
        "system": name,
        "strategy": "FULL_SHARD",
        "world_size": WORLD,
        "activation_checkpointing": ac,
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


if __name__ == "__main__":
    main()

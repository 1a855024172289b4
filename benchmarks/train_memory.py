"""``train.py memory``: peak RSS per rank at scale against the floor, each fullshard system against torch FSDP2
with the same activation checkpointing / accumulation, and DDP under an address-space cap (see ``train.py``)."""

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
from typing import Any

import torch
import torch.distributed as dist
from kit import AC_SUFFIX, DDP, MEMORY, System, system

from fullshard.testing.bench import (
    RssSampler,
    activation_bytes,
    label_phases,
    machine,
    on_fresh_ranks,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch

WORLD = 2  # gloo CPU ranks
GiB = 2**30


# ==== memory: peak RSS at scale ==============================================================================


MAIN_SYSTEMS = [f"{w}{ac}" for w in MEMORY for ac in ("", AC_SUFFIX)]
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
        from fullshard.engine import unit_state as state

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
        rows = run_system(DDP, cfg, 2, batch, 1, as_limit=as_limit)
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
    default = [f"{w}{s}" for w in MEMORY for s in ("", SHARDED_ACC)] if args.accumulate > 1 else MAIN_SYSTEMS
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
            f"{DDP} under RLIMIT_AS={cap / GiB:.1f} GiB per rank (needs {16 * psi / GiB:.1f} GiB of state "
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
    parsed = {n: parse_memory_system(n) for n in systems}
    if not any(chosen.key == chosen.baseline for chosen, _ in parsed.values()):  # no torch FSDP2 row
        return
    print("\nagainst torch FSDP2 with the same activation checkpointing / accumulation mode:")
    for name, res in systems.items():
        chosen, sharded_acc = parsed[name]
        twin = next((n for n, (c, acc) in parsed.items() if c.is_baseline_of(chosen) and acc == sharded_acc), None)
        if twin is None or not chosen.ours:
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
    entry = {
        "model_config": {**cfg.__dict__, "params": param_count(cfg), "local_batch": args.batch},
        "entry_point": chosen.entry_point,
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


def memory_args(p: argparse.ArgumentParser) -> None:
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

"""The engine on N CUDA GPUs: fullshard's entry points beside torch's FSDP1, FSDP2 and DDP, one NCCL rank per GPU.

    python benchmarks/gpu.py [--size medium|large|tiny] [--ranks N] [--steps 10] [--warmup 3] [--systems NAME ...]
        [--profile_steps 2] [--out F.json] [--profile] [--phases] [--device cuda|cpu]

``--ranks`` (default: every GPU) spawns one rank per GPU on NCCL (start the script with ``python``, not
torchrun); each rank trains the same model on its own ``batch`` sequences of a global batch (the work per GPU
stays that of one GPU as N grows). With one GPU the shard
group has one rank, so no byte crosses a link: what differs between the systems is what each does around the
compute (the all-gather and reduce-scatter calls and their copies, the hooks, the optimizer over flat or
per-parameter shards, mixed-precision casts) and the memory each holds. Every rank runs each system in turn from
the same weights on the same batches; per system: the median step time of the slowest rank (forward, backward,
AdamW, zero_grad, with the GPU synchronised around each step) and its ratio to the system's baseline in the kit
(torch FSDP2 of the same precision), the largest peak GPU memory allocated of the ranks
(``torch.cuda.max_memory_allocated``, reset once the model is on the GPU, so it counts the model states) and its
ratio, the overlap of communication with compute, and rank 0's first and last losses, which must agree with the
baseline's within a precision (fp32 rows: with TF32 off, every system computes the same products).

Overlap: ``--profile_steps`` more steps (after the timed ones, so profiling costs the step times nothing) run
under ``torch.profiler``; "hidden" is the fraction of the all-gather and reduce-scatter kernels' time during
which another kernel ran (``benchmarks/overlap.py``), the mean over ranks, and "comm ms" that time per step
(slowest rank); "-" where a system runs neither (DDP all-reduces; one rank may communicate nothing).

Sizes: ``medium`` is the issue's medium GPT (8 blocks, width 512, vocabulary 8192, 16 sequences of 256 per rank),
where the step is short and per-call overheads show; ``large`` is the 840M GPT of ``train.py memory`` (16 blocks,
width 2048) at 8 sequences of 512, where the compute dominates; ``tiny`` (2 blocks of width 64) checks the script.

``--device cpu`` runs the same on ``--ranks`` gloo CPU ranks (default 2; peak memory is then the peak RSS of the
rank): a smoke test of the script where there is no GPU (``python benchmarks/gpu.py --device cpu --size tiny
--steps 1 --warmup 1``), not a measurement.

``--profile`` also prints, per system, rank 0's ops that took the most CPU time (self) over the profiled steps:
where a system's time goes beyond the compute the systems share. ``--phases`` prints, per system, rank 0's memory
allocated (and the peak since the previous point) after each phase of the last timed step: where a system's peak
comes from.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from kit import FSDP2, GPU_BF16, GPU_FP32, System, system
from overlap import measure as measure_overlap
from torch import nn

from fullshard.testing.bench import describe_machine, on_fresh_ranks, peak_rss_bytes, reset_peak_rss, rss_bytes
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch

SIZES = {
    "medium": (GPTConfig(vocab_size=8192, block_size=256, n_layer=8, n_head=8, n_embd=512), 16),
    "large": (GPTConfig(vocab_size=8192, block_size=512, n_layer=16, n_head=16, n_embd=2048), 8),
    "tiny": (GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=64), 2),
}
NO_WRAPPER = "one GPU, no wrapper"
GiB = 2**30


class _Device:
    """What differs between a CUDA rank and a CPU rank: synchronising, and where the peak memory comes from."""

    def __init__(self, kind: str) -> None:
        self.kind, self.cuda = kind, kind == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak_rss()

    def allocated_gib(self) -> float:
        return (torch.cuda.memory_allocated() if self.cuda else rss_bytes()) / GiB

    def peak_gib(self) -> float:
        return (torch.cuda.max_memory_allocated() if self.cuda else peak_rss_bytes()) / GiB

    def release(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def measure(
    rank: int, name: str, cfg: GPTConfig, batches: list[Any], args: dict[str, Any], device: _Device
) -> dict[str, Any]:
    """One system's row on this rank: median step ms after the warm-up, peak GiB, overlap, losses."""
    torch.manual_seed(0)
    model: nn.Module = TinyGPT(cfg).to(device.kind)
    device.reset_peak()
    chosen: System | None = None if name == NO_WRAPPER else system(name)
    if chosen is not None:
        model = chosen.build(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    timed = args["warmup"] + args["steps"]
    times, losses, phases = [], [], []

    def record(phase: str) -> None:
        device.sync()
        phases.append((phase, device.allocated_gib(), device.peak_gib()))

    def skip(phase: str) -> None:
        pass

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    for i, (x, y) in enumerate(batches):
        if i == timed:
            profiler.start()
        mark = record if i == timed - 1 else skip  # the phases of the last timed step only
        device.sync()
        start = time.perf_counter()
        mark("before the step")
        loss = model(x, y)
        mark("forward")
        loss.backward()
        mark("backward")
        optimizer.step()
        mark("optimizer step")
        optimizer.zero_grad(set_to_none=True)
        mark("zero_grad")
        device.sync()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    row: dict[str, Any] = {"hidden": None, "comm_ms": 0.0, "top_ops": None}
    if len(batches) > timed:
        profiler.stop()
        row.update(measure_overlap(profiler.events(), device.cuda, len(batches) - timed))
        if args["profile"] and rank == 0:
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)
            row["top_ops"] = table
    row.update(
        system=name,
        bf16=bool(chosen and chosen.bf16),
        step_ms=statistics.median(times[args["warmup"] : timed]) * 1e3,
        first_step_ms=times[0] * 1e3,
        peak_gib=device.peak_gib(),
        losses=losses[:timed],
        phases=phases,  # (phase, GiB allocated after it, peak GiB so far) in the last timed step
    )
    del model, optimizer, loss
    device.release()
    return row


def _rank(rank: int, world: int, names: list[str], args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every system in turn on this rank; the batches are this rank's rows of the same global batches."""
    device = _Device(args["device"])
    if device.cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 rows compute the same products on every system
        torch.backends.cudnn.allow_tf32 = False
    cfg, batch = SIZES[args["size"]]
    batches = []
    for i in range(args["warmup"] + args["steps"] + args["profile_steps"]):
        x, y = make_batch(cfg, batch * world, i)
        rows = slice(rank * batch, (rank + 1) * batch)
        batches.append((x[rows].to(device.kind), y[rows].to(device.kind)))
    out = [measure(rank, name, cfg, batches, args, device) for name in names]
    dist.barrier()
    return out


def combine(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per system: the slowest rank's step, the largest peak, the mean hidden fraction, rank 0's losses."""
    rows = []
    for same in zip(*per_rank):
        hidden = [r["hidden"] for r in same if r["hidden"] is not None]
        rows.append(
            {
                **same[0],
                "step_ms": max(r["step_ms"] for r in same),
                "first_step_ms": max(r["first_step_ms"] for r in same),
                "peak_gib": max(r["peak_gib"] for r in same),
                "hidden": statistics.mean(hidden) if hidden else None,
                "hidden_per_rank": [r["hidden"] for r in same],
                "comm_ms": max(r["comm_ms"] for r in same),
            }
        )
    return rows


def report(rows: list[dict[str, Any]], world: int, args: argparse.Namespace) -> None:
    def reference(row: dict[str, Any]) -> dict[str, Any] | None:
        want = FSDP2 if row["system"] == NO_WRAPPER else system(row["system"]).baseline
        return next((r for r in rows if r["system"] == want), None)

    print(f"\n{'system':42} {'step ms':>9} {'x FSDP2':>8} {'peak GiB':>9} {'x FSDP2':>8} {'hidden':>7} "
          f"{'comm ms':>8} {'1st ms':>8}  losses")  # fmt: skip
    for row in rows:
        ref = reference(row)
        time_ratio = f"{row['step_ms'] / ref['step_ms']:.3f}" if ref else "-"
        mem_ratio = f"{row['peak_gib'] / ref['peak_gib']:.3f}" if ref else "-"
        hidden = f"{row['hidden']:.0%}" if row["hidden"] is not None else "-"
        comm = f"{row['comm_ms']:.2f}" if row["hidden"] is not None else "-"
        print(f"{row['system']:42} {row['step_ms']:9.2f} {time_ratio:>8} {row['peak_gib']:9.2f} {mem_ratio:>8} "
              f"{hidden:>7} {comm:>8} {row['first_step_ms']:8.0f}  "
              f"{row['losses'][0]:.5f} .. {row['losses'][-1]:.5f}")  # fmt: skip
        # without a wrapper, each of several ranks trains on its own rows only: its losses part from the others'
        if ref and not (row["system"] == NO_WRAPPER and world > 1):
            tol = 2e-2 if row["bf16"] else 1e-4
            drift = max(abs(a - b) for a, b in zip(row["losses"], ref["losses"]))
            assert drift <= tol, f"{row['system']}: losses differ from {ref['system']} by {drift:.2e} (> {tol})"
    for row in rows:
        if row["top_ops"]:
            print(f"\n--- {row['system']}: rank 0's ops with the most self CPU time over {args.profile_steps} steps")
            print(row["top_ops"])
    if args.phases:
        for row in rows:
            shown = ", ".join(f"{phase} {now:.2f} (peak {peak:.2f})" for phase, now, peak in row["phases"])
            print(f"{row['system']}: GiB allocated after {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="medium")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo ranks, a smoke test")
    parser.add_argument("--ranks", type=int, default=None, help="one per GPU (default: all of them; CPU: 2)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--profile_steps", type=int, default=2, help="profiled steps after the timed ones (overlap)")
    parser.add_argument("--systems", nargs="+", default=[NO_WRAPPER, *GPU_FP32, *GPU_BF16])
    parser.add_argument("--out", help="write the rows here as JSON")
    parser.add_argument("--profile", action="store_true", help="print each system's top ops by self CPU time")
    parser.add_argument("--phases", action="store_true", help="print memory after each phase of the last step")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        raise SystemExit("benchmarks/gpu.py starts its own ranks (one per GPU): run it with python, not torchrun")
    for name in args.systems:
        if name != NO_WRAPPER:
            system(name)  # an unknown name fails here, before any rank starts
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU: torch.cuda.is_available() is False (or --device cpu)")
    world = args.ranks or (torch.cuda.device_count() if cuda else 2)
    if cuda and world > torch.cuda.device_count():
        raise SystemExit(f"--ranks {world}: one rank per GPU, and {torch.cuda.device_count()} GPUs are visible")
    print(describe_machine())
    if cuda:
        print(f"GPU: {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"NCCL {torch.cuda.nccl.version()}")  # fmt: skip
    cfg, batch = SIZES[args.size]
    params = sum(p.numel() for p in TinyGPT(cfg).parameters())
    print(f"model: {args.size} GPT, {cfg.n_layer} blocks x width {cfg.n_embd}, {params / 1e6:.1f}M parameters; "
          f"{world} {'NCCL' if cuda else 'gloo CPU'} rank(s), batch {batch} x {cfg.block_size} per rank; "
          f"{args.warmup} warm-up + {args.steps} timed + {args.profile_steps} profiled steps; AdamW; "
          "TF32 off")  # fmt: skip
    per_rank = on_fresh_ranks(_rank, args.systems, vars(args), world=world, backend="nccl" if cuda else "gloo")
    rows = combine(per_rank)
    report(rows, world, args)
    if args.out:
        saved = [{k: v for k, v in r.items() if k != "top_ops"} for r in rows]
        gpu = torch.cuda.get_device_name() if cuda else None
        with open(args.out, "w") as f:
            json.dump({"size": args.size, "device": args.device, "ranks": world, "gpu": gpu, "torch": torch.__version__,
                       "rows": saved}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()

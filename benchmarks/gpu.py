"""The engine on one CUDA GPU: fullshard's entry points beside torch's FSDP1, FSDP2 and DDP, one NCCL rank.

    python benchmarks/gpu.py [--size medium|large] [--steps 10] [--warmup 3] [--systems NAME ...] [--out F.json]
        [--profile] [--phases]

With one GPU the shard group has one rank, so no byte crosses a link: what differs between the systems is what
each does around the compute (the all-gather and reduce-scatter calls and their copies, the hooks, the
optimizer over flat or per-parameter shards, mixed-precision casts) and the memory each holds. Each system runs
in this process from the same weights on the same batches; per system: the median step time (forward, backward,
AdamW, zero_grad, with the GPU synchronised around each step) and its ratio to torch FSDP2 of the same precision,
the peak GPU memory allocated (``torch.cuda.max_memory_allocated``, reset once the model is on the GPU, so it
counts the model states) and its ratio, and the first and last losses, which must agree within a precision
(fp32 rows: with TF32 off, every system computes the same products).

Sizes: ``medium`` is the issue's medium GPT (8 blocks, width 512, vocabulary 8192, 16 sequences of 256), where
the step is short and per-call overheads show; ``large`` is the 840M GPT of ``train.py memory`` (16 blocks, width
2048) at 8 sequences of 512, where the compute dominates.

``--profile`` also prints, per system, the ops that took the most CPU time (self) over the timed steps, from
``torch.profiler``: where a system's time goes beyond the compute the systems share. ``--phases`` prints, per
system, the GPU memory allocated (and the peak since the previous point) after each phase of the last step:
where a system's peak comes from.
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
from torch import nn

from fullshard.testing.bench import describe_machine
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch

SIZES = {
    "medium": (GPTConfig(vocab_size=8192, block_size=256, n_layer=8, n_head=8, n_embd=512), 16),
    "large": (GPTConfig(vocab_size=8192, block_size=512, n_layer=16, n_head=16, n_embd=2048), 8),
}
NO_WRAPPER = "one GPU, no wrapper"


def _one_rank() -> None:
    """A one-rank NCCL group on this process's GPU (or the one torchrun gave it)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))


def measure(
    name: str, cfg: GPTConfig, batches: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, profile: bool = False
) -> dict:
    """One system's row: median step ms after ``warmup`` steps, peak GiB, first and last loss."""
    torch.manual_seed(0)
    model: nn.Module = TinyGPT(cfg).cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    chosen: System | None = None if name == NO_WRAPPER else system(name)
    if chosen is not None:
        model = chosen.build(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, losses, phases = [], [], []

    def record(phase: str) -> None:
        torch.cuda.synchronize()
        phases.append((phase, torch.cuda.memory_allocated() / 2**30, torch.cuda.max_memory_allocated() / 2**30))

    def skip(phase: str) -> None:
        pass

    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    for i, (x, y) in enumerate(batches):
        if profiler is not None and i == warmup:
            profiler.start()
        mark = record if i == len(batches) - 1 else skip  # the phases of the last step only
        torch.cuda.synchronize()
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
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    if profiler is not None:
        profiler.stop()
        print(f"\n--- {name}: the ops with the most self CPU time over {len(batches) - warmup} steps")
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    row = {
        "system": name,
        "bf16": bool(chosen and chosen.bf16),
        "step_ms": statistics.median(times[warmup:]) * 1e3,
        "first_step_ms": times[0] * 1e3,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": losses,
        "phases": phases,  # (phase, GiB allocated after it, peak GiB so far) in the last step
    }
    del model, optimizer, loss
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="medium")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--systems", nargs="+", default=[NO_WRAPPER, *GPU_FP32, *GPU_BF16])
    parser.add_argument("--out", help="write the rows here as JSON")
    parser.add_argument("--profile", action="store_true", help="print each system's top ops by self CPU time")
    parser.add_argument("--phases", action="store_true", help="print GPU memory after each phase of the last step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU: torch.cuda.is_available() is False")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 rows compute the same products on every system
    torch.backends.cudnn.allow_tf32 = False
    _one_rank()
    print(describe_machine())
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
    cfg, batch = SIZES[args.size]
    params = sum(p.numel() for p in TinyGPT(cfg).parameters())
    print(f"model: {args.size} GPT, {cfg.n_layer} blocks x width {cfg.n_embd}, {params / 1e6:.1f}M parameters; "
          f"batch {batch} x {cfg.block_size}; {args.warmup} warm-up + {args.steps} timed steps; AdamW; "
          "TF32 off")  # fmt: skip
    batches = [tuple(t.cuda() for t in make_batch(cfg, batch, i)) for i in range(args.warmup + args.steps)]
    rows = [measure(name, cfg, batches, args.warmup, args.profile) for name in args.systems]  # type: ignore[arg-type]

    def reference(row: dict[str, Any]) -> dict[str, Any] | None:
        want = FSDP2 if row["system"] == NO_WRAPPER else system(row["system"]).baseline
        return next((r for r in rows if r["system"] == want), None)

    print(f"\n{'system':42} {'step ms':>9} {'x FSDP2':>8} {'peak GiB':>9} {'x FSDP2':>8} {'1st ms':>8}  losses")
    for row in rows:
        ref = reference(row)
        time_ratio = f"{row['step_ms'] / ref['step_ms']:.3f}" if ref else "-"
        mem_ratio = f"{row['peak_gib'] / ref['peak_gib']:.3f}" if ref else "-"
        print(f"{row['system']:42} {row['step_ms']:9.2f} {time_ratio:>8} {row['peak_gib']:9.2f} {mem_ratio:>8} "
              f"{row['first_step_ms']:8.0f}  {row['losses'][0]:.5f} .. {row['losses'][-1]:.5f}")  # fmt: skip
        if ref:
            tol = 2e-2 if row["bf16"] else 1e-4
            drift = max(abs(a - b) for a, b in zip(row["losses"], ref["losses"]))
            assert drift <= tol, f"{row['system']}: losses differ from {ref['system']} by {drift:.2e} (> {tol})"
    if args.phases:
        for row in rows:
            shown = ", ".join(f"{phase} {now:.2f} (peak {peak:.2f})" for phase, now, peak in row["phases"])
            print(f"{row['system']}: GiB allocated after {shown}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"size": args.size, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

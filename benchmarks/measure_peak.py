"""Peak RSS per rank of a few training steps of a GPT under fullshard, for calibrating ``estimate-memory``.

    python benchmarks/measure_peak.py --layers 4 --width 512 --world 1 2 4 [--strategies FULL_SHARD ...] [--ac]
        [--batch 2] [--seq 128] [--vocab 8192] [--heads 8] [--steps 3] [--out peaks.json]

Each (world, strategy) runs in fresh gloo processes with ``MALLOC_MMAP_THRESHOLD_=131072`` (so that freed
tensors go back to the OS and RSS follows what is live) unless ``--glibc-default``. The model is built on
the meta device and materialised unit by unit (``param_init_fn``), so no rank ever holds the full model.
Per rank it records the RSS before the model is built (the interpreter + torch + the process group), and the
peak RSS (the kernel's ``VmHWM``, not ``ru_maxrss``, which a spawned rank inherits from its parent: see
``fullshard.testing.memory``) after ``--steps`` AdamW steps, and prints them beside ``estimate-memory``'s
prediction for the same configuration. ``--out`` appends the rows to a JSON list.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from torch import nn

from fullshard import FSDP, apply_activation_checkpointing
from fullshard.engine.api import ShardingStrategy
from fullshard.frontend.estimate import estimate_training
from fullshard.testing import WorkerPool
from fullshard.testing.memory import peak_rss_bytes, rss_bytes
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.wrap import ModuleWrapPolicy

GIB = 2**30


def _init(module: nn.Module) -> None:
    module.to_empty(device="cpu", recurse=False)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    for p in module.parameters(recurse=False):
        if p.dim() == 1 and p.numel() == 1:
            p.data.fill_(1.0)  # TinyGPT.logit_scale


def _train(rank: int, world: int, cfg: GPTConfig, strategy: str, batch: int, steps: int, ac: bool) -> dict:
    torch.set_num_threads(1)
    base = rss_bytes()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    if ac:
        apply_activation_checkpointing(model, lambda m: isinstance(m, Block))
    model = FSDP(model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}), param_init_fn=_init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for step in range(steps):
        x, y = make_batch(cfg, batch, seed=step * world + rank)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"base": base, "peak": peak_rss_bytes(), "loss": losses[-1]}


def measure(cfg: GPTConfig, world: int, strategy: str, batch: int, steps: int, ac: bool) -> dict:
    pool = WorkerPool(world, timeout_s=3600)  # a loaded shared machine is slow; the memory figures are not
    try:
        rows = pool.run(_train, cfg, strategy, batch, steps, ac)
    finally:
        pool.close()
    return {
        "layers": cfg.n_layer,
        "width": cfg.n_embd,
        "heads": cfg.n_head,
        "vocab": cfg.vocab_size,
        "seq": cfg.block_size,
        "batch": batch,
        "world": world,
        "strategy": strategy,
        "activation_checkpointing": ac,
        "base_bytes": max(r["base"] for r in rows),
        "peak_bytes": max(r["peak"] for r in rows),
        "peak_bytes_per_rank": [r["peak"] for r in rows],
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }


def _config_of(row: dict) -> tuple[GPTConfig, int, int, str, bool]:
    """(config, batch, world, strategy, AC) of a row of ours or of bench_scale.py's peaks.json."""
    if "model_config" in row:  # benchmarks/bench_scale.py (branch scale)
        c = row["model_config"]
        cfg = GPTConfig(vocab_size=c["vocab_size"], block_size=c["block_size"], n_layer=c["n_layer"],
                        n_head=c["n_head"], n_embd=c["n_embd"])  # fmt: skip
        return cfg, c["local_batch"], row["world_size"], row["strategy"], row["activation_checkpointing"]
    cfg = GPTConfig(vocab_size=row["vocab"], block_size=row["seq"], n_layer=row["layers"], n_head=row["heads"],
                    n_embd=row["width"])  # fmt: skip
    return cfg, row["batch"], row["world"], row["strategy"], row["activation_checkpointing"]


def compare(paths: list[Path]) -> None:
    """Measured peaks (JSON rows from here or from bench_scale.py) beside today's estimate."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="2: the second step runs with Adam's states")
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategies", nargs="+", default=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    parser.add_argument("--ac", action="store_true", help="activation checkpointing of every block")
    parser.add_argument("--glibc-default", action="store_true", help="leave MALLOC_MMAP_THRESHOLD_ unset")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--compare", type=Path, nargs="+", default=None,
                        help="measure nothing: print these JSON files' peaks beside today's estimate")  # fmt: skip
    args = parser.parse_args()
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
            row = measure(cfg, world, strategy, args.batch, args.steps, args.ac)
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


if __name__ == "__main__":
    main()

"""``train.py peak``: peak RSS per rank of a few FSDP steps per world size and strategy beside estimate-memory's
prediction, or saved rows beside today's estimate (``--compare``); see ``train.py``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from fullshard.cli.memory_estimate import estimate_training
from fullshard.engine.api import ShardingStrategy
from fullshard.testing.bench import (
    peak_rss_of_training,
)
from fullshard.testing.models import Block, GPTConfig, TinyGPT

GIB = 2**30


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


def peak_args(p: argparse.ArgumentParser) -> None:
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

"""Train a small character-level GPT on the shipped corpus with fullshard, one process per rank.

    fullshard launch --num_processes 2 examples/train_gpt.py --steps 60
    # or: torchrun --nproc_per_node 2 examples/train_gpt.py --steps 60

Each rank reads its own slice of every batch; parameters, gradients and optimizer states are sharded
(FULL_SHARD, one unit per transformer block). Rank 0 prints the loss averaged over ranks.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from fullshard import FullyShardedDataParallel
from fullshard.testing.models import Block, GPTConfig, TinyGPT
from fullshard.wrap import ModuleWrapPolicy

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def load_corpus() -> tuple[torch.Tensor, int]:
    text = CORPUS.read_text()
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    return torch.tensor([index[ch] for ch in text], dtype=torch.long), len(vocab)


def batch_at(data: torch.Tensor, step: int, batch: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
    x = torch.stack([data[s : s + block] for s in starts])
    y = torch.stack([data[s + 1 : s + block + 1] for s in starts])
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    data, vocab = load_corpus()
    cfg = GPTConfig(vocab_size=vocab, block_size=64, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)
    model = FullyShardedDataParallel(TinyGPT(cfg), auto_wrap_policy=ModuleWrapPolicy({Block}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    per_rank = args.batch // world
    for step in range(args.steps):
        x, y = batch_at(data, step, args.batch, cfg.block_size)
        loss = model(x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank])
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {mean.item() / world:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

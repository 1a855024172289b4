"""``checkpoint.py async``: the time ``save_state`` holds the training loop, with and without ``async_save``
(see ``checkpoint.py``)."""

import argparse
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from checkpoint_disk import WORLD

from fullshard import Accelerator, FullyShardedDataParallelPlugin
from fullshard.checkpoint import background
from fullshard.frontend.saving import state_io
from fullshard.testing.bench import RssSampler, on_fresh_ranks
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch

# ==== async ==============================================================================================


def _async_rank(
    rank: int, world: int, cfg_args: dict[str, int], workdir: str, rounds: int, steps: int, device: str = "cpu"
) -> Any:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    sampler = RssSampler(0.002, keep_samples=False).start()
    cfg = GPTConfig(**cfg_args)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=2, sharding_strategy="FULL_SHARD", state_dict_type="SHARDED_STATE_DICT",
            auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"],
        )
    )  # fmt: skip
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    target = accelerator.device if device == "cuda" else torch.device("cpu")
    model.to_empty(device=target)
    with torch.no_grad():
        for param in model.parameters():  # drawn on the CPU (its generator), then copied to the shard's device
            local = param.to_local()
            local.copy_(torch.empty(local.shape).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(rank)))
    x, y = make_batch(cfg, world, seed=0)
    x, y = x[rank : rank + 1].to(target), y[rank : rank + 1].to(target)

    def step() -> float:
        t = time.perf_counter()
        accelerator.backward(model(x, y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as in a training loop
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    sampler.set_phase("train")
    first = step()  # the optimizer state exists from here on
    rows = []
    for r in range(rounds):
        for mode in ("sync", "async"):  # alternating, in the same run
            folder = Path(workdir) / f"{mode}_{r}"
            dist.barrier()
            sampler.set_phase(f"{mode} {r}")
            t = time.perf_counter()
            accelerator.save_state(folder, async_save=mode == "async")
            blocked = time.perf_counter() - t
            step_s = [step() for _ in range(steps)]  # during the background write, for async
            t = time.perf_counter()
            state_io.wait_for_save()  # what the next save_state would wait for
            waited = time.perf_counter() - t
            sampler.set_phase("idle")
            rows.append({"mode": mode, "blocked": blocked, "steps": step_s, "waited": waited})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder)
    peaks = sampler.stop()
    kept = background.buffers().nbytes()  # the host buffers async saves keep until end_training
    result = {"rank": rank, "rows": rows, "peaks": peaks, "first_step": first, "params": n_params, "kept": kept}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, result)
    return everyone if rank == 0 else None


def async_main(args: argparse.Namespace) -> None:
    cfg = {"vocab_size": args.vocab, "block_size": 128, "n_layer": args.layers, "n_head": 16, "n_embd": args.width}
    work = Path(args.workdir) / "bench_checkpoint_async"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        device, world, backend = ("cuda", 1, "nccl") if args.cuda else ("cpu", WORLD, "gloo")
        ranks = on_fresh_ranks(_async_rank, cfg, str(work), args.rounds, args.steps, device, world=world,
                               backend=backend)[0]  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gib = 2**30
    print(
        f"\nGPT {args.layers} layers x {args.width}, vocabulary {args.vocab}: {ranks[0]['params'] / 1e6:.0f}M "
        f"parameters, FULL_SHARD, SHARDED_STATE_DICT, AdamW, "
        f"{'1 NCCL rank on ' + torch.cuda.get_device_name() if args.cuda else f'{WORLD} gloo ranks'}, "
        "1 thread each; load average "
        f"{os.getloadavg()}"
    )
    print(f"first training step {max(r['first_step'] for r in ranks):.1f} s")
    print(f"{'round':>5} {'mode':<6} {'blocked s':>10} {'steps s (max over ranks)':>30} {'then waited s':>14}")
    for i in range(len(ranks[0]["rows"])):
        rows = [r["rows"][i] for r in ranks]
        steps = [max(s) for s in zip(*(row["steps"] for row in rows), strict=True)]
        print(
            f"{i // 2:>5} {rows[0]['mode']:<6} {max(row['blocked'] for row in rows):10.2f} "
            f"{', '.join(f'{s:.2f}' for s in steps):>30} {max(row['waited'] for row in rows):14.2f}"
        )
    print(f"peak RSS per rank, train phase: {max(r['peaks']['train'] for r in ranks) / gib:.2f} GiB")
    for i in range(args.rounds):
        for mode in ("sync", "async"):
            phase = f"{mode} {i}"
            print(f"peak RSS per rank, round {i} {mode:<5}: {max(r['peaks'][phase] for r in ranks) / gib:.2f} GiB")
    print(f"host buffers kept by async saves per rank: {max(r['kept'] for r in ranks) / gib:.2f} GiB")


def async_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=12288, help="with 5 x 2048: 302M parameters")
    parser.add_argument("--rounds", type=int, default=2, help="sync/async pairs, alternating in one run")
    parser.add_argument("--steps", type=int, default=2, help="training steps after each save, before waiting")
    parser.add_argument("--workdir", default="/tmp/fullshard-bench/ckasync")
    parser.add_argument("--cuda", action="store_true", help="one NCCL rank on this machine's GPU")

"""LoRA fine-tuning memory and step time: fullshard against torch FSDP2, 2 gloo ranks, one run.

A ``LlamaForCausalLM`` from a config (no download), its base in bf16 and frozen, PEFT LoRA adapters (fp32, PEFT's
default) on the attention and MLP projections; one unit per decoder layer and the root, bf16 gathers and
reductions (what ``Accelerator(mixed_precision="bf16")`` sets); AdamW over the adapters. Each system runs on fresh
ranks (``fullshard.testing.bench.on_fresh_ranks``); a rank's peak is its ``VmHWM`` from just before the first step
to the end, minus its RSS then (the sharded model, the interpreter), plus the sharded model's bytes: so the peak
counts what the run holds (shards, gathers, gradients, optimizer state, activations), not the model each rank built
whole before sharding. The floor is the frozen base in bf16 / N + the adapters' fp32 weights, gradients and two
AdamW moments / N. Systems and their names come from ``kit.py``.

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/lora.py --hidden 512 --layers 4 --steps 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from kit import LORA_BASELINE, LORA_SYSTEMS

from fullshard.testing.bench import describe_machine, on_fresh_ranks
from fullshard.testing.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(args: argparse.Namespace) -> Any:
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    base = LlamaForCausalLM(config).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=args.rank, target_modules=TARGETS))  # adapters in fp32
    return model, type(base.model.layers[0])


def _local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _run(rank: int, world: int, name: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, layer_cls = _model(args)
    model = LORA_SYSTEMS[name](model, layer_cls)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    shards = _local_bytes(model.parameters())
    gen = torch.Generator().manual_seed(rank)
    times, losses = [], []
    start_rss = rss_bytes()
    reset_peak_rss()
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        begin = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - begin)
        losses.append(loss.item())
    return {
        "peak": peak_rss_bytes() - start_rss + shards,
        "shards": shards,
        "adapters": _local_bytes(trainable),
        "step": statistics.median(times[1:] or times),
        "loss": losses[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--systems", nargs="+", default=list(LORA_SYSTEMS))
    args = parser.parse_args()
    print(f"machine: {describe_machine()}; load average {os.getloadavg()[0]:.2f} at start")
    rows = {}
    for name in args.systems:
        rows[name] = on_fresh_ranks(_run, name, args)
    load = os.getloadavg()[0]
    base = rows.get(LORA_BASELINE)
    mib = 2**20
    for name, ranks in rows.items():
        peak = max(r["peak"] for r in ranks)
        step = statistics.median(r["step"] for r in ranks)
        adapters = ranks[0]["adapters"]
        floor = ranks[0]["shards"] + 3 * adapters  # + fp32 gradients and two AdamW moments of the adapters
        line = (
            f"{name:24s} peak/rank {peak / mib:8.1f} MiB (floor {floor / mib:7.1f}, x{peak / floor:.2f})  "
            f"step {step * 1e3:8.1f} ms  loss {ranks[0]['loss']:.4f}"
        )
        if base is not None and name != LORA_BASELINE:
            base_peak = max(r["peak"] for r in base)
            base_step = statistics.median(r["step"] for r in base)
            line += f"  vs {LORA_BASELINE}: peak x{peak / base_peak:.2f}, step x{step / base_step:.2f}"
        print(line)
    print(f"load average {load:.2f} at the end")


if __name__ == "__main__":
    main()

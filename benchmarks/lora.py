"""LoRA fine-tuning memory and step time: fullshard against torch FSDP2 as Accelerate drives it, 2 gloo ranks, one run.

A ``LlamaForCausalLM`` from a config (no download), its base frozen in bf16, PEFT LoRA adapters (fp32, PEFT's
default) on the seven attention and MLP projections, AdamW over the adapters, bf16 compute. ``--size 840m`` is the
840M GPT of ``train.py memory`` (16 layers of width 2048, vocabulary 8192) as a Llama; ``small`` (the default) is
4 layers of 512. Each system runs on fresh ranks (``fullshard.testing.bench.on_fresh_ranks``), one after another.
The systems and their names are ``kit.py``'s ``LORA_SYSTEMS``; the base is one of BASES here (``--base``, one or
more, each with every system): ``bf16``, or ``nf4`` for QLoRA (the seven projections' weights as torchao
``NF4Tensor``s, which torch's FSDP2 and fullshard both shard through the all-gather extension protocol).

A rank's peak is its ``VmHWM`` over the steps (``fullshard.testing.memory``, reset once the model is wrapped, as
``train.py memory`` measures) minus its RSS before it built the model (the interpreter and its imports, printed
apart): what the run holds (shards, gathered units, gradients, optimizer state, activations, and whatever wrapping
left behind), not the whole model each rank builds before sharding. The floor is what any sharded run must hold:
the frozen base in its dtype / N plus, per trainable parameter, its weight, gradient and two AdamW moments (and an
fp32 master where it is not fp32) / N; no activations, no gathered unit. A 4-bit weight counts as stored: its
codes, block scales and their quantization factors.

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/lora.py                          # small: 4 x 512, 6 steps
    MALLOC_MMAP_THRESHOLD_=131072 nice -n 5 python benchmarks/lora.py --size 840m     # 16 x 2048, 1 + 3 steps
    MALLOC_MMAP_THRESHOLD_=131072 nice -n 5 python benchmarks/lora.py --size 840m --base nf4 bf16   # + QLoRA
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from kit import LORA_BASELINE, LORA_SYSTEMS
from torch import nn

from fullshard.testing.bench import RssSampler, describe_machine, label_phases, on_fresh_ranks
from fullshard.testing.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# --size: the model and the run; flags given on the command line win
SIZES: dict[str, dict[str, int]] = {
    "small": {"hidden": 512, "layers": 4, "vocab": 8192, "seq": 128, "batch": 2, "steps": 6},
    "840m": {"hidden": 2048, "layers": 16, "vocab": 8192, "seq": 64, "batch": 1, "steps": 4},
}
GiB, MiB = 2**30, 2**20


def _bf16_base(config: Any) -> nn.Module:
    """The base built in bf16 directly (no fp32 copy of 840M parameters on the way)."""
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return LlamaForCausalLM(config).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(previous)


def _nf4_base(config: Any) -> nn.Module:
    """QLoRA's base: the bf16 base with the weights of the seven projections converted to torchao ``NF4Tensor``s
    (4-bit codes, one int8 scale per block of 64 weights, those scales double-quantized per ``_scaler_block``
    blocks: 256, ``to_nf4``'s default, at both sizes); embeddings, norms and head stay bf16."""
    from torchao.quantization import to_nf4

    model = _bf16_base(config)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            weight = module.weight.detach()
            nf4 = to_nf4(weight, NF4_BLOCK, _scaler_block(weight.shape[0] // 2 * weight.shape[1] // NF4_BLOCK))
            module.weight = nn.Parameter(nf4, requires_grad=False)
    return model


NF4_BLOCK = 64  # weights per int8 block scale (``to_nf4``'s default)


def _scaler_block(blocks_per_shard: int) -> int:
    """The largest double-quantization block, at most ``to_nf4``'s 256, that divides a 2-rank shard's blocks (a
    shard must hold whole scaler blocks to be sharded with its metadata)."""
    return next(size for size in (256, 128, 64, 32, 16, 8, 4, 2, 1) if blocks_per_shard % size == 0)


# --base: how the frozen base is stored.
BASES = {"bf16": _bf16_base, "nf4": _nf4_base}


def _model(args: argparse.Namespace, base_name: str) -> tuple[nn.Module, type[nn.Module]]:
    import peft
    from transformers import LlamaConfig

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
    base = BASES[base_name](config)
    model = peft.get_peft_model(base, peft.LoraConfig(r=args.rank, target_modules=TARGETS))  # adapters in fp32
    return model, type(base.model.layers[0])


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor as stored (a DTensor's local shard; an ``NF4Tensor``'s 4-bit codes, block scales and
    their quantization factors, without its 16-entry table and scale mean, which every rank keeps whole)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if hasattr(local, "quantized_data"):  # torchao NF4Tensor
        return sum(x.nbytes for x in (local.quantized_data, local.quantized_scalers, local.quantization_factor))
    return local.numel() * local.element_size()


def floor_parts(model: nn.Module, world: int) -> dict[str, int]:
    """Bytes per rank any sharded LoRA run of ``model`` (unwrapped) must hold: the frozen weights as stored (4-bit
    ones apart), the trainable ones with their gradients, two AdamW moments in their dtype and an fp32 master if
    they are not fp32; everything / ``world``."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    quantized = sum(tensor_bytes(p) for p in frozen if _is_quantized(p))
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = sum(tensor_bytes(p) for p in trainable)
    master = sum(p.numel() * 4 for p in trainable if p.dtype != torch.float32)
    parts = {
        "frozen": sum(tensor_bytes(p) for p in frozen) // world,
        "adapters": weights // world,
        "adapter grads": weights // world,
        "AdamW moments": 2 * weights // world,
        "fp32 master": master // world,
    }
    if quantized:  # the frozen part split: NF4 codes + scales, and the rest (bf16 embeddings, norms, head)
        parts = {"frozen NF4": quantized // world, "frozen, not quantized": parts["frozen"] - quantized // world,
                 **{k: v for k, v in parts.items() if k != "frozen"}}  # fmt: skip
    return parts


def _is_quantized(p: torch.Tensor) -> bool:
    return hasattr(p, "quantized_data")


def _kind(p: torch.Tensor) -> str:
    local = p.to_local() if hasattr(p, "to_local") else p
    return f"{'trainable' if p.requires_grad else 'frozen'} {type(local).__name__ if _is_quantized(local) else p.dtype}"


def _run(rank: int, world: int, name: str, base: str, args: argparse.Namespace) -> dict[str, Any]:
    import peft  # noqa: F401  (imported before the baseline: the interpreter's share)
    import transformers  # noqa: F401

    torch.set_num_threads(1)
    gc.collect()
    baseline = rss_bytes()
    model, layer_cls = _model(args, base)
    floor = floor_parts(model, world)
    params = sum(p.numel() for p in model.parameters())
    model = LORA_SYSTEMS[name](model, layer_cls)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    dtypes = sorted({_kind(p) for p in model.parameters()})
    gen = torch.Generator().manual_seed(rank)
    times, losses = [], []
    gc.collect()
    after_wrap = rss_bytes()
    sampler = RssSampler(keep_samples=False)
    if args.phases:  # where the peak is: RSS by phase (forward i / backward i of decoder layer i, loss, ...)
        label_phases(model, [m for m in model.modules() if isinstance(m, layer_cls)], sampler)
        sampler.start()
    dist.barrier()
    reset_peak_rss()
    for step in range(args.steps):
        sampler.set_phase(f"step {step} start")
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        dist.barrier()
        begin = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        sampler.set_phase("optimizer step")
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - begin)
        losses.append(loss.item())
    if args.phases:
        sampler.stop()
    return {
        "phases": {phase: rss - baseline for phase, rss in sampler.peaks.items()} if args.phases else {},
        "peak": peak_rss_bytes() - baseline,
        "after_wrap": after_wrap - baseline,
        "baseline": baseline,
        "floor": floor,
        "params": params,
        "dtypes": dtypes,
        "steps": times,
        "losses": losses,
    }


def _step(ranks: list[dict[str, Any]]) -> float:
    """Median over the steps after the first (warm-up) of the slowest rank's step."""
    steps = [max(r["steps"][i] for r in ranks) for i in range(len(ranks[0]["steps"]))]
    return statistics.median(steps[1:] or steps)


def _report(rows: dict[str, list[dict[str, Any]]], loads: dict[str, tuple[float, float]], base_name: str) -> None:
    base = rows.get(LORA_BASELINE)
    any_rank = next(iter(rows.values()))[0]
    floor = sum(any_rank["floor"].values())
    parts = ", ".join(f"{k} {v / MiB:.1f}" for k, v in any_rank["floor"].items())
    print(
        f"{base_name} base: {any_rank['params'] / 1e6:.1f}M parameters; floor per rank {floor / GiB:.3f} GiB "
        f"({parts} MiB)"
    )
    for name, ranks in rows.items():
        peak, step = max(r["peak"] for r in ranks), _step(ranks)
        line = (
            f"{name + ' [' + base_name + ']':52s} peak/rank {peak / GiB:6.3f} GiB (x{peak / floor:.2f} floor; after "
            f"wrap {max(r['after_wrap'] for r in ranks) / GiB:.3f}; interpreter {ranks[0]['baseline'] / GiB:.2f})  "
            f"step {step:7.2f} s  losses {[round(v, 4) for v in ranks[0]['losses']]}  "
            f"load {loads[name][0]:.1f}-{loads[name][1]:.1f}  {', '.join(ranks[0]['dtypes'])}"
        )
        if base is not None and name != LORA_BASELINE:
            line += (
                f"  vs {LORA_BASELINE}: peak x{peak / max(r['peak'] for r in base):.2f}, step x{step / _step(base):.2f}"
            )
        print(line, flush=True)
        top = sorted(ranks[0]["phases"].items(), key=lambda kv: -kv[1])[:8]
        if top:
            print("    rank 0's largest RSS by phase (GiB): " + ", ".join(f"{k} {v / GiB:.3f}" for k, v in top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument(
        "--base", nargs="+", choices=list(BASES), default=["bf16"], help="one or more; each base with every system"
    )
    for flag in ("hidden", "layers", "vocab", "seq", "batch", "steps"):
        parser.add_argument(f"--{flag}", type=int, help=f"overrides --size's {flag}")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--phases", action="store_true", help="sample RSS by phase (adds a sampling thread)")
    parser.add_argument("--systems", nargs="+", default=list(LORA_SYSTEMS), choices=list(LORA_SYSTEMS))
    args = parser.parse_args()
    for flag, value in SIZES[args.size].items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    print(f"machine: {describe_machine()}")
    print(f"run: {vars(args)}", flush=True)
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {base: {} for base in args.base}
    loads: dict[str, dict[str, tuple[float, float]]] = {base: {} for base in args.base}
    for base in args.base:
        for name in args.systems:
            start = os.getloadavg()[0]
            rows[base][name] = on_fresh_ranks(_run, name, base, args)
            loads[base][name] = (start, os.getloadavg()[0])
            _report({name: rows[base][name]}, loads[base], base)
    print("--- all rows")
    for base in args.base:
        _report(rows[base], loads[base], base)


if __name__ == "__main__":
    main()

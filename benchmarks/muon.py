"""Matrix optimizers on shards: fullshard + Muon (whole-parameter steps) beside fullshard + AdamW and torch FSDP2
+ ``torch.optim.Muon``, on 2 gloo ranks.

    python benchmarks/muon.py [--layers 8 --width 512 --batch 8 --accumulate 1 --steps 6] [--no-peak] [--out F]
    python benchmarks/muon.py --floor [--steps 6]   # Muon's own cost: unsharded, one process

``--accumulate K``: every optimizer step takes K micro-batches of ``--batch`` sequences (forward and backward
each, gradients reduced as they are made), as a run with a larger global batch than fits at once does. Muon's
Newton-Schulz and its exchange are paid once per optimizer step, the forward and backward K times: the step
ratio to AdamW against tokens per step.


The rows (``kit.MATRIX_OPTIMIZER_ROWS``): each a kit system (one ``fully_shard`` unit per ``Block`` and the root)
and an optimizer set-up as users write it:

- ``adamw``: AdamW (lr 3e-4) on every parameter: the baseline of the ratios;
- ``muon-whole``: fullshard's ``muon`` without the split step (``_can_split`` answers no): pipelined, the owner
  receiving the parameter, gradient and momentum whole and sending back the parameter and momentum, as before
  the split (``[Note: split Muon steps]``);
- ``muon-serial``: fullshard's ``muon`` with the pipeline turned off (``_can_pipeline`` answers no): the exchange
  as it was before it, gather everything, step, scatter everything, for a before/after in the same run;
- ``muon``: ``torch.optim.Muon`` (lr 0.02) on the blocks' 2-D matrices, AdamW on the rest (embeddings, norms,
  biases); on fullshard, ``whole_param_step(model, muon)``: each matrix stepped whole by one owning rank, the
  unsharded Muon's update. torch FSDP2's Muon runs Newton-Schulz on ``DTensor`` row shards: **not the unsharded
  update** (issue 33: 4.9e-3 off after 3 steps); its figures are shown for cost only.

Times: every row is built side by side in the same ranks, and each step runs them all on the same batch, the
order reversed on every other step, so that a shared machine's load falls on all alike; a row's step ends with
its slowest rank; ratios are the median over steps of the per-step ratio to ``adamw`` (paired). Beside the step,
where the optimizer step's time goes, from timers around fullshard's functions (the slowest rank, median over
steps): the gather (the pre-step hook: its ``all_to_all`` and the byte copies into whole tensors), Newton-Schulz
(``torch.optim._muon._zeropower_via_newtonschulz``, every call), the scatter (the post-step hook's exchange: its
``all_to_all`` and the copies into the shards), and the rest of ``step()`` (momentum, AdamW on the others).
From the second step Muon's exchange is pipelined (``WholeParamStep._pipeline``): then ``pipeline`` is the
pre-hook's whole time (posting every gather, waiting slot by slot, Newton-Schulz and the rest of each matrix's
step, posting its scatter: Newton-Schulz is inside it) and ``finish`` the waits and copies of the posted
scatters (in the pipeline and in the post-hook).

``--floor``: the same model unsharded in one process (one thread, the whole global batch), AdamW against the same
Muon set-up, interleaved and paired the same way: the step ratio that Muon's own math costs over AdamW's with no
exchange at all, which no sharding of the step can go under (each rank of a balanced sharded run does half of this
process's forward, backward and Newton-Schulz).

Peak memory: each row alone in fresh ranks (``MALLOC_MMAP_THRESHOLD_=131072``), the kernel's ``VmHWM`` per rank
after ``--peak-steps`` steps, as a ratio to ``adamw``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from kit import MATRIX_OPTIMIZER_ROWS, system
from torch import nn

import fullshard.algorithms.whole_step as whole_step
from fullshard import whole_param_step
from fullshard.testing.bench import describe_machine, on_fresh_ranks
from fullshard.testing.memory import peak_rss_bytes, rss_bytes
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch

GATHER, SCATTER, NS, PIPELINE, FINISH = "gather", "scatter", "newton-schulz", "pipeline", "finish"
PHASES = (GATHER, f"{GATHER} all_to_all", NS, SCATTER, f"{SCATTER} all_to_all", PIPELINE, FINISH)


def label(row: tuple[str, str]) -> str:
    return f"{row[0]} + {row[1]}"


class Timers:
    """Seconds per phase in the current step, from wrappers around fullshard's and torch's functions."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.current = ""

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            key = f"{self.current} {name}" if name == "all_to_all" else name
            outer, self.current = self.current, name if name != "all_to_all" else self.current
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
                self.current = outer

        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        muon_module, hook = torch.optim._muon, whole_step.WholeParamStep
        with (
            mock.patch.object(hook, "_gather", self.wrap(GATHER, hook._gather)),
            mock.patch.object(hook, "_scatter", self.wrap(SCATTER, hook._scatter)),
            mock.patch.object(hook, "_pipeline", self.wrap(PIPELINE, hook._pipeline)),
            mock.patch.object(hook, "_finish_scatter", self.wrap(FINISH, hook._finish_scatter)),
            mock.patch.object(whole_step, "_all_to_all_into", self.wrap("all_to_all", whole_step._all_to_all_into)),
            mock.patch.object(
                muon_module, "_zeropower_via_newtonschulz", self.wrap(NS, muon_module._zeropower_via_newtonschulz)
            ),
        ):
            yield


def build(row: tuple[str, str], cfg: GPTConfig) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    """The row's model (seed 0) and optimizers, as a user sets them up."""
    name, optimizer = row
    torch.manual_seed(0)
    model = system(name).build(TinyGPT(cfg))
    opts = optimizers(model, optimizer)
    if optimizer != "adamw" and system(name).ours:
        hook = whole_param_step(model, opts[0])
        if optimizer == "muon-serial":  # the exchange as before the pipeline: gather all, step, scatter all
            hook._can_pipeline = lambda bucket: False  # type: ignore[method-assign]
        if optimizer == "muon-whole":  # pipelined, whole tensors exchanged: as before the split step
            hook._can_split = lambda bucket: False  # type: ignore[method-assign]
    return model, opts


def optimizers(model: nn.Module, optimizer: str) -> list[torch.optim.Optimizer]:
    """AdamW over everything, or Muon (first) over the blocks' matrices and AdamW over the rest, as users set it up."""
    if optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=3e-4)]
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-4)]


def timed_step(
    model: nn.Module, opts: list[torch.optim.Optimizer], batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple:
    """One optimizer step over ``batches`` (micro-batches whose gradients accumulate, each reduced as it is made, as
    every system does by default): (seconds in all, seconds in the optimizers, the last micro-batch's loss)."""
    start = time.perf_counter()
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
    mid = time.perf_counter()
    for opt in opts:
        opt.step()
    for opt in opts:
        opt.zero_grad()
    end = time.perf_counter()
    return end - start, end - mid, loss


def _shard(rank: int, world: int, cfg: GPTConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = make_batch(cfg, batch, seed=seed)
    per = batch // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _micro_batches(rank: int, world: int, cfg: GPTConfig, batch: int, step: int, accumulate: int) -> list[tuple]:
    """This rank's share of each of the step's ``accumulate`` global micro-batches (seeds distinct across steps)."""
    return [_shard(rank, world, cfg, batch, step * accumulate + k) for k in range(accumulate)]


def _timed(
    rank: int, world: int, rows: list[tuple[str, str]], cfg: GPTConfig, batch: int, steps: int, accumulate: int
) -> dict:
    """Every row side by side; per step and row: step and optimizer seconds, the phases, the loss."""
    torch.set_num_threads(1)
    built = [build(row, cfg) for row in rows]
    timers = Timers()
    out: dict[str, dict[str, list[float]]] = {label(r): defaultdict(list) for r in rows}
    with timers.installed():
        for step in range(steps):
            batches = _micro_batches(rank, world, cfg, batch, step, accumulate)
            order = list(range(len(rows))) if step % 2 == 0 else list(range(len(rows)))[::-1]
            for i in order:
                model, opts = built[i]
                rec = out[label(rows[i])]
                timers.seconds.clear()
                dist.barrier()
                step_s, optimizer_s, loss = timed_step(model, opts, batches)
                rec["step_s"].append(step_s)
                rec["optimizer_s"].append(optimizer_s)
                rec["loss"].append(loss.item())
                for phase in PHASES:
                    rec[phase].append(timers.seconds.get(phase, 0.0))
    return {k: dict(v) for k, v in out.items()}


def _floor(cfg: GPTConfig, batch: int, steps: int, warm: int, accumulate: int) -> dict[str, dict[str, float]]:
    """Unsharded AdamW and Muon in this process, side by side on the same batches (see ``--floor``)."""
    torch.set_num_threads(1)
    rows: dict[str, tuple[nn.Module, list[torch.optim.Optimizer]]] = {}
    for optimizer in ("adamw", "muon"):
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        rows[optimizer] = (model, optimizers(model, optimizer))
    timers = Timers()
    out: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in rows}
    with timers.installed():
        for step in range(steps):
            batches = _micro_batches(0, 1, cfg, batch, step, accumulate)
            for name in list(rows) if step % 2 == 0 else list(rows)[::-1]:
                model, opts = rows[name]
                timers.seconds.clear()
                step_s, optimizer_s, _ = timed_step(model, opts, batches)
                out[name]["step_s"].append(step_s)
                out[name]["optimizer_s"].append(optimizer_s)
                out[name][NS].append(timers.seconds.get(NS, 0.0))
    base = out["adamw"]["step_s"][warm:]
    return {
        name: {
            "step_ms": 1000 * statistics.median(r["step_s"][warm:]),
            "ratio": statistics.median(t / b for t, b in zip(r["step_s"][warm:], base, strict=True)),
            "optimizer_ms": 1000 * statistics.median(r["optimizer_s"][warm:]),
            f"{NS}_ms": 1000 * statistics.median(r[NS][warm:]),
        }
        for name, r in out.items()
    }


def _peak(
    rank: int, world: int, row: tuple[str, str], cfg: GPTConfig, batch: int, steps: int, accumulate: int
) -> dict[str, int]:
    torch.set_num_threads(1)
    base = rss_bytes()
    model, opts = build(row, cfg)
    for step in range(steps):
        for x, y in _micro_batches(rank, world, cfg, batch, step, accumulate):
            model(x, y).backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()
    return {"base": base, "peak": peak_rss_bytes()}


def summarise(per_rank: list[dict], rows: list[tuple[str, str]], warm: int) -> dict[str, dict[str, Any]]:
    """Per row: medians over the timed steps of the slowest rank's figures, and the paired ratio to the first row."""
    names = [label(r) for r in rows]
    steps = len(per_rank[0][names[0]]["step_s"])

    def slowest(name: str, key: str) -> list[float]:
        return [max(r[name][key][s] for r in per_rank) for s in range(warm, steps)]

    base = slowest(names[0], "step_s")
    result = {}
    for name in names:
        times = slowest(name, "step_s")
        result[name] = {
            "step_ms": 1000 * statistics.median(times),
            "ratio": statistics.median(t / b for t, b in zip(times, base, strict=True)),
            "optimizer_ms": 1000 * statistics.median(slowest(name, "optimizer_s")),
            **{f"{p}_ms": 1000 * statistics.median(slowest(name, p)) for p in PHASES},
            "losses": per_rank[0][name]["loss"],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences of 64)")
    parser.add_argument(
        "--accumulate",
        type=int,
        default=1,
        metavar="K",
        help="micro-batches of --batch per optimizer step (Newton-Schulz is paid once per step)",
    )
    parser.add_argument("--steps", type=int, default=6, help="steps per row, the first --warm left out")
    parser.add_argument("--warm", type=int, default=2)
    parser.add_argument("--peak-steps", type=int, default=2)
    parser.add_argument("--no-peak", action="store_true", help="skip the peak memory runs")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--no-fsdp2", action="store_true", help="leave out torch FSDP2's row (the slowest)")
    parser.add_argument("--floor", action="store_true", help="unsharded AdamW against Muon in one process")
    parser.add_argument("--out", default=None, help="write the figures as JSON")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    rows = list(MATRIX_OPTIMIZER_ROWS)
    rows[2:2] = [(rows[1][0], "muon-whole"), (rows[1][0], "muon-serial")]  # the paths before, in the same run
    if args.no_fsdp2:
        rows = [row for row in rows if system(row[0]).ours]
    params = sum(p.numel() for p in TinyGPT(cfg).parameters())
    print(f"machine: {describe_machine()}")
    print(f"TinyGPT {args.layers} x {args.width} ({params / 1e6:.1f}M parameters), batch {args.batch} x 64, "
          f"{args.accumulate} micro-batch(es) per step ({args.accumulate * args.batch * 64} tokens), "
          f"{args.world} gloo ranks, {args.steps} steps ({args.warm} warm-up)")  # fmt: skip
    if args.floor:
        floor = _floor(cfg, args.batch, args.steps, min(args.warm, args.steps - 1), args.accumulate)
        print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"{'unsharded, one process':42} {'step ms':>8} {'x':>5} {'optim':>7} {NS:>18}")
        for name, r in floor.items():
            print(f"{name:42} {r['step_ms']:8.1f} {r['ratio']:5.2f} {r['optimizer_ms']:7.1f} {r[f'{NS}_ms']:18.1f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"machine": describe_machine(), "config": vars(args), "floor": floor}, f, indent=1)
        return
    per_rank = on_fresh_ranks(
        _timed, rows, cfg, args.batch, args.steps, args.accumulate, world=args.world, timeout_s=3 * 3600
    )
    result = summarise(per_rank, rows, min(args.warm, args.steps - 1))
    peaks: dict[str, list[int]] = {}
    if not args.no_peak:
        # Only the peak ranks (spawned after this) run with it: freed tensors leave RSS. The timed ranks run with the
        # allocator every benchmark gives every system (testing/bench.py), or a step would pay a page fault for
        # every buffer above 128 KiB it allocates.
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
        for row in rows:
            ranks = on_fresh_ranks(
                _peak, row, cfg, args.batch, args.peak_steps, args.accumulate, world=args.world, timeout_s=3600
            )
            peaks[label(row)] = [r["peak"] for r in ranks]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average after: {load}")
    first = label(rows[0])
    header = f"{'row':42} {'step ms':>8} {'x':>5} {'optim':>7} " + " ".join(f"{p:>18}" for p in PHASES)
    print(header + f" {'peak MiB/rank':>14} {'x':>5}")
    for name, r in result.items():
        cells = " ".join(f"{r[f'{p}_ms']:18.1f}" for p in PHASES)
        line = f"{name:42} {r['step_ms']:8.1f} {r['ratio']:5.2f} {r['optimizer_ms']:7.1f} {cells}"
        if peaks:
            r["peak_bytes_per_rank"] = peaks[name]
            r["peak_ratio"] = max(peaks[name]) / max(peaks[first])
            line += f" {max(peaks[name]) / 2**20:14.0f} {r['peak_ratio']:5.2f}"
        print(line)
    for name, r in result.items():
        print(f"losses {name}: " + ", ".join(f"{x:.5f}" for x in r["losses"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": describe_machine(), "load_after": load, "config": vars(args), "rows": result}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()

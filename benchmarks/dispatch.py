"""What a training step dispatches, counted (not timed): the CPU overhead of each system, free of the machine's noise.

    python benchmarks/dispatch.py [--world 1 2] [--layers 8] [--width 64] [--systems NAME ...] [--ops N] [--bytes]

A step whose kernels are short (a GPU, or a small model) is bound by the CPU work around them: ATen ops dispatched
(each a dispatcher round trip, and on a GPU a kernel launch for most), tensor subclass (``DTensor``) dispatches and
Python calls. These counts are deterministic, so two systems (or two commits) compare exactly on a shared
machine where wall-clock times swing by 15%. Per system and world size (gloo ranks, rank 0 reported), after two
warm-up steps, AdamW with ``foreach=True`` (the default on a GPU; the CPU default is the per-parameter loop):

- ``aten``: ATen ops per step by phase (forward, backward, ``optimizer.step()``), from ``torch.profiler`` events
  (every op, nested ones included, as the profiler counts ``aten::view`` and friends);
- ``py``: Python function calls per phase (``sys.setprofile``), where hooks and ``DTensor`` construction cost;
- ``dtensors``: ``DTensor`` objects built per step (``_FromTorchTensor`` or the direct constructor);
- with ``--ops N``, each phase's N ops whose counts differ most between the first system and each other one;
- with ``--bytes``, the bytes written per phase by the ops that move memory (:data:`MOVES`: copies into and out of
  flat buffers, concatenations, the reduction's sums and averages, fills), per op, from one more step under a
  ``TorchDispatchMode`` on the training thread (gloo's own copies, on its threads, are not seen). These depend
  on the sizes: give the model's ``--width`` (``--width 512`` for the medium GPT's bytes).

The model is ``TinyGPT`` with ``--layers`` blocks of width ``--width`` (vocabulary 256, sequence 16, batch 4): the
counts depend on the number of parameters and units, not on their sizes, so a small model gives the medium GPT's
counts (8 blocks, 94 parameters, 9 units) in seconds.
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Any

import torch
from kit import DISPATCH, system
from torch.distributed.tensor import DTensor
from torch.profiler import profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from fullshard.testing.bench import describe_machine, on_fresh_ranks
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch

PHASES = ("fwd", "bwd", "opt")
DEFAULT_SYSTEMS = list(DISPATCH)
STEPS = 3  # profiled steps, averaged (every step dispatches the same ops)


class _DTensorCount:
    """Counts ``DTensor`` objects created (``DTensor.__new__`` is the one constructor every path goes through)."""

    def __init__(self) -> None:
        self.count = 0
        self._original = DTensor.__new__

    def __enter__(self) -> _DTensorCount:
        original = self._original

        def counted(cls: type, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(cls, *args, **kwargs)

        DTensor.__new__ = counted  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        DTensor.__new__ = self._original  # type: ignore[method-assign]


# Ops whose output is memory moved rather than computed (and the model's residual adds, which every system has).
MOVES = frozenset(
    [
        "copy_",
        "_to_copy",
        "cat",
        "split_with_sizes_copy",
        "clone",
        "_foreach_copy_",
        "zero_",
        "zeros",
        "fill_",
        "add_",
        "add",
        "div_",
        "_chunk_cat",
    ]
)


class _BytesWritten(TorchDispatchMode):
    """Bytes written per op (name in :data:`MOVES`): its outputs, its ``out=`` tensors, or its in-place target."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in MOVES:
            written = result if result is not None else kwargs.get("out", args[0] if args else None)
            tensors = written if isinstance(written, (list, tuple)) else [written]
            self.bytes[name] += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        return result


def _python_calls(fn: Any) -> tuple[Any, int]:
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(count)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, calls


def _count(rank: int, world: int, name: str, cfg: GPTConfig, bytes_too: bool = False) -> dict[str, Any]:
    with system(name).environment():  # what the system's name says (", unchecked": no header) while it steps too
        return _count_steps(rank, world, name, cfg, bytes_too)


def _count_steps(rank: int, world: int, name: str, cfg: GPTConfig, bytes_too: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = system(name).build(TinyGPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    batches = [make_batch(cfg, 4, world * i + rank) for i in range(3 + STEPS)]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with record_function("PHASE fwd"):
            loss = model(x, y)
        with record_function("PHASE bwd"):
            loss.backward()
        with record_function("PHASE opt"):
            opt.step()
        opt.zero_grad(set_to_none=True)

    for x, y in batches[:2]:
        step(x, y)
    x, y = batches[2]
    py = {}
    loss, py["fwd"] = _python_calls(lambda: model(x, y))
    _, py["bwd"] = _python_calls(loss.backward)
    _, py["opt"] = _python_calls(opt.step)
    opt.zero_grad(set_to_none=True)
    written = {}
    if bytes_too:  # one more step (every step moves the same bytes), apart from the counted ones
        x, y = make_batch(cfg, 4, world * (3 + STEPS) + rank)
        modes = {p: _BytesWritten() for p in PHASES}
        with modes["fwd"]:
            loss = model(x, y)
        with modes["bwd"]:
            loss.backward()
        with modes["opt"]:
            opt.step()
        written = {p: dict(mode.bytes) for p, mode in modes.items()}
        opt.zero_grad(set_to_none=True)
    with profile() as prof, _DTensorCount() as dtensors:
        for x, y in batches[3:]:
            step(x, y)
    events = prof.events()
    spans = [(e.time_range.start, e.time_range.end, e.name[6:]) for e in events if e.name.startswith("PHASE ")]
    ops: dict[str, collections.Counter[str]] = {p: collections.Counter() for p in PHASES}
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        for start, end, phase in spans:
            if start <= e.time_range.start <= end:
                ops[phase][e.name] += 1
                break
    return {
        "ops": {p: {k: v / STEPS for k, v in c.items()} for p, c in ops.items()},
        "py": py,
        "dtensors": dtensors.count / STEPS,
        "bytes": written,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS)
    parser.add_argument("--ops", type=int, default=0, help="show the N ops whose counts differ most per phase")
    parser.add_argument("--bytes", action="store_true", help="also the MB written per phase by memory-moving ops")
    args = parser.parse_args()
    print(describe_machine())
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=args.layers, n_head=4, n_embd=args.width)
    for world in args.world:
        print(f"\n{world} rank(s): per step, rank 0; aten ops | Python calls, by phase")
        print(f"{'system':32} {'fwd':>11} {'bwd':>11} {'opt':>11} {'total aten':>10} {'py':>7} {'DTensors':>8}")
        rows = {name: on_fresh_ranks(_count, name, cfg, args.bytes, world=world)[0] for name in args.systems}
        for name, row in rows.items():
            aten = {p: sum(row["ops"][p].values()) for p in PHASES}
            cells = " ".join(f"{aten[p]:5.0f}|{row['py'][p]:<5d}" for p in PHASES)
            total_py = sum(row["py"].values())
            print(f"{name:32} {cells} {sum(aten.values()):10.0f} {total_py:7d} {row['dtensors']:8.0f}")
        for name, row in rows.items() if args.bytes else ():
            for p in PHASES:
                moved = row["bytes"][p]
                top = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(moved.items(), key=lambda kv: -kv[1]))
                print(f"  MB written, {name}, {p}: {sum(moved.values()) / 1e6:.2f} ({top})")
        first = args.systems[0]
        for name in args.systems[1:] if args.ops else []:
            for p in PHASES:
                a, b = rows[first]["ops"][p], rows[name]["ops"][p]
                diff = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, 0) - b.get(k, 0)))[: args.ops]
                shown = ", ".join(f"{k[6:]} {a.get(k, 0):.0f}/{b.get(k, 0):.0f}" for k in diff if a.get(k) != b.get(k))
                print(f"  {p} {first} / {name}: {shown}")


if __name__ == "__main__":
    main()

"""What every benchmark measures with, and what tests reuse of it: the machine, memory over time, fresh ranks.

- :func:`machine` / :func:`describe_machine`: the one description of this CPU the benchmarks print (model name,
  AVX-512 BF16 / AMX or AVX2 only, from the kernel's ``/proc/cpuinfo`` flags; cores; torch; load).
- :class:`RssSampler`: RSS over time on a daemon thread, by phase; peaks come from ``VmHWM``
  (:mod:`fullshard.testing.memory`), with :func:`label_phases` and :func:`activation_bytes` beside it.
- :func:`on_fresh_ranks`: the one way a benchmark starts ranks (a :class:`~fullshard.testing.WorkerPool` of
  its own, closed afterwards, so one measurement's allocator state never leaks into the next one's).
- :func:`peak_rss_of_training`: peak RSS per rank of a few FSDP steps (``benchmarks/train.py peak`` and the
  estimate-memory test).
- :func:`ring_reduce_scatter`: the ring algorithm ``benchmarks/collectives.py`` compares with the engine's.

The systems compared (fullshard's entry points beside torch's FSDP1, FSDP2 and DDP) live in
``benchmarks/kit.py``: nothing under ``src/`` may import torch's FSDP (``tests/unit/test_import_layers.py``).
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard import FSDP, apply_activation_checkpointing
from fullshard.engine import allocator_set_by_user, keep_freed_memory, p2p
from fullshard.testing.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.testing.pool import WorkerPool
from fullshard.wrap import ModuleWrapPolicy

__all__ = [
    "RssSampler",
    "activation_bytes",
    "cpu_flags",
    "describe_machine",
    "label_phases",
    "machine",
    "on_fresh_ranks",
    "peak_rss_bytes",
    "peak_rss_of_training",
    "reset_peak_rss",
    "ring_reduce_scatter",
    "rss_bytes",
    "run_mode",
]

# The flags that decide how this CPU computes in bf16 (and how fast gloo copies): shown by every benchmark.
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


# --- the machine -------------------------------------------------------------------------------------------


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in ``/proc/cpuinfo``; ("", empty) where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "", set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:  # x86, ARM
            flags = set(value.split())
    return model, flags


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel reports them (``/proc/cpuinfo``); empty off Linux."""
    return _cpuinfo()[1]


def machine() -> dict[str, str]:
    """This machine as every benchmark prints and records it.

    ``bf16`` says whether bf16 arithmetic is native (AVX-512 BF16 or AMX: the figures of a Xeon with AMX) or
    emulated (AVX2 only: torch converts to fp32 and back); ``cores`` is how many CPUs this process may run on
    (what the ranks share), ``cpus`` how many the machine has.
    """
    model, flags = _cpuinfo()
    if {"avx512_bf16", "amx_bf16"} & flags:
        bf16 = "native (AVX-512 BF16/AMX)"
    elif "avx2" in flags:
        bf16 = "emulated (AVX2 only)"
    else:
        bf16 = "unknown" if not flags else "emulated (no AVX2)"
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "flags": " ".join(f for f in SIMD_FLAGS if f in flags),
        "bf16": bf16,
        "cores": str(len(os.sched_getaffinity(0))),
        "cpus": str(os.cpu_count()),
        "torch": torch.__version__,
        "load": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "default"),
    }


def describe_machine() -> str:
    """:func:`machine` on one line, for the top of a benchmark's output."""
    m = machine()
    return (
        f"{m['cpu']}, {m['cores']} of {m['cpus']} CPUs, flags {m['flags'] or '-'}, bf16 {m['bf16']}, "
        f"torch {m['torch']}, load average {m['load']}, "
        f"malloc {'as the environment sets it' if allocator_set_by_user() else 'keeps freed memory (every system)'}"
    )


# --- memory over time -----------------------------------------------------------------------------------


class RssSampler:
    """Samples this process's RSS every ``interval_s`` on a daemon thread, each sample tagged with the phase the
    caller last set (:meth:`set_phase`); keeps each phase's largest sample (``peaks``) and, with
    ``keep_samples``, every sample as ``(seconds since start, RSS bytes, phase)`` (``samples``, a timeline).

    Torch's large kernels and gloo's waits release the GIL, so the thread keeps sampling through them; a
    spike shorter than the interval can be missed, so exact peaks come from :func:`peak_rss_bytes` (``VmHWM``).
    RSS shows frees only if the allocator returns memory: run with ``MALLOC_MMAP_THRESHOLD_=131072``.
    Use as a context manager, or :meth:`start` / :meth:`stop`.
    """

    def __init__(self, interval_s: float = 0.005, *, keep_samples: bool = True) -> None:
        self.interval_s = interval_s
        self.keep_samples = keep_samples
        self.phase = "idle"
        self.samples: list[tuple[float, int, str]] = []
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.perf_counter()

    def _record(self, phase: str) -> None:
        value = rss_bytes()
        if value > self.peaks.get(phase, 0):
            self.peaks[phase] = value
        if self.keep_samples:
            self.samples.append((time.perf_counter() - self.t0, value, phase))

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self._record(phase)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._record(self.phase)
            time.sleep(self.interval_s)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, int]:
        """Stop sampling; return the peak RSS of every phase."""
        self._stop.set()
        self._thread.join()
        return self.peaks

    def __enter__(self) -> RssSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def label_phases(model: nn.Module, blocks: list[nn.Module], sampler: RssSampler) -> None:
    """Announce ``forward i`` / ``backward i`` as each block runs (hooks on the blocks themselves, so they
    fire the same under every wrapper); recomputation during backward shows as ``recompute i``."""
    in_backward = {"on": False}

    def pre(i: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            sampler.set_phase(f"{'recompute' if in_backward['on'] else 'forward'} {i}")

        return hook

    def post(i: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:

                def on_grad(grad: torch.Tensor) -> None:
                    in_backward["on"] = True
                    sampler.set_phase(f"backward {i}")

                output.register_hook(on_grad)

        return hook

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(pre(i))
        block.register_forward_hook(post(i))

    def model_pre(module: nn.Module, args: Any) -> None:
        in_backward["on"] = False

    def model_post(module: nn.Module, args: Any, output: Any) -> None:
        sampler.set_phase("loss")

    model.register_forward_pre_hook(model_pre)
    model.register_forward_hook(model_post)


def activation_bytes(block: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward of ``block`` on ``x``, parameters excluded."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    seen[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()  # the next block's input
    return sum(seen.values())


# --- scripts with modes -----------------------------------------------------------------------------------


def run_mode(doc: str, modes: dict[str, tuple[Callable[..., Any], Callable[..., Any], str]]) -> None:
    """A benchmark script's ``main``: ``modes`` maps each mode to (add its arguments, run it, one-line summary);
    parse the command line, print the machine, run the chosen mode."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="mode", required=True)
    for name, (add_args, _, summary) in modes.items():
        add_args(subparsers.add_parser(name, help=summary, description=summary))
    args = parser.parse_args()
    print(f"machine: {describe_machine()}")
    modes[args.mode][1](args)


# --- ranks -------------------------------------------------------------------------------------------------


def on_fresh_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world: int = 2,
    timeout_s: float = 3600.0,
    grace_s: float = 600.0,
    backend: str = "gloo",
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` freshly spawned ranks (gloo, or ``backend``); the results in rank order.

    The ranks are stopped afterwards, so each call starts from a fresh allocator and interpreter. The long
    default timeouts are for a loaded shared machine, where a medium model's steps take minutes.

    Every system a rank runs shares its C allocator's settings, and the engine changes them at its first CPU
    unit (``engine/cpu_memory.py``: freed memory kept for reuse); so that a peer measured before or after a
    fullshard system in the same rank is not measured under other settings, each rank applies them first
    (``FULLSHARD_CPU_KEEP_FREED_MEMORY=0`` or the user's own ``MALLOC_*`` settings: glibc's defaults for all).
    """
    pool = WorkerPool(world, timeout_s=timeout_s, grace_s=grace_s, backend=backend, start_method="spawn")
    try:
        return pool.run(_under_one_allocator_setting, fn, *args)
    finally:
        pool.close()


def _under_one_allocator_setting(rank: int, world: int, fn: Callable[..., Any], *args: Any) -> Any:
    keep_freed_memory()
    return fn(rank, world, *args)


# --- peak memory of a training run -------------------------------------------------------------------------


def _materialize_unit(module: nn.Module) -> None:
    """``param_init_fn``: this module's own meta tensors get storage and their initial values."""
    module.to_empty(device="cpu", recurse=False)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    for p in module.parameters(recurse=False):
        if p.dim() == 1 and p.numel() == 1:
            p.data.fill_(1.0)  # TinyGPT.logit_scale


def _train_for_peak(rank: int, world: int, cfg: GPTConfig, strategy: str, batch: int, steps: int, ac: bool) -> dict:
    torch.set_num_threads(1)
    base = rss_bytes()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    if ac:
        apply_activation_checkpointing(model, lambda m: isinstance(m, Block))
    model = FSDP(
        model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}), param_init_fn=_materialize_unit
    )
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


def peak_rss_of_training(cfg: GPTConfig, world: int, strategy: str, batch: int, steps: int, ac: bool) -> dict:
    """Peak RSS per rank of ``steps`` AdamW steps of ``cfg`` under ``FullyShardedDataParallel`` on ``world``
    fresh ranks (one unit per block, built on the meta device and materialised unit by unit, so no rank ever
    holds the whole model), and each rank's RSS before the model was built (``base``).

    The peak is the kernel's ``VmHWM`` of each rank, never its parent's (see :mod:`fullshard.testing.memory`).
    Set ``MALLOC_MMAP_THRESHOLD_=131072`` before calling so that freed tensors leave RSS.
    """
    rows = on_fresh_ranks(_train_for_peak, cfg, strategy, batch, steps, ac, world=world)
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


# --- a collective to compare with -------------------------------------------------------------------------


def ring_reduce_scatter(output: torch.Tensor, full: torch.Tensor, pg: dist.ProcessGroup) -> p2p.P2PWork:
    """``output`` becomes the sum over ranks of chunk ``rank`` of ``full``, in ``n - 1`` ring steps.

    Step ``s`` sends the partial sum of chunk ``rank - s - 1`` to the right and receives that of chunk
    ``rank - s - 2`` from the left, adding this rank's piece; the last one received is chunk ``rank``'s
    complete sum (added from the rank after the owner round to the owner). Each step needs the previous one's
    result, so the call posts the first and ``wait()`` runs the rest, where they cannot overlap with compute:
    one reason the engine uses the pairwise exchange instead (for 2 ranks the two are the same).
    """
    n, rank = pg.size(), pg.rank()
    chunks = full.view(n, -1)
    if n == 1:
        output.copy_(chunks[0])
        return p2p.P2PWork([])
    right, left = (rank + 1) % n, (rank - 1) % n
    partial = torch.empty(2, chunks.shape[1], dtype=full.dtype)  # one being sent while the other is summed
    incoming = torch.empty_like(partial)

    def step(s: int, outgoing: torch.Tensor) -> list[dist.Work]:
        tag = p2p.REDUCE_SCATTER_TAG
        return [pg.send([outgoing], right, tag), pg.recv([incoming[s % 2]], left, tag)]

    first = step(0, chunks[(rank - 1) % n])

    def finish() -> None:
        pending = first
        for s in range(n - 1):
            for work in pending:
                work.wait()
            last = s == n - 2
            target = output if last else partial[s % 2]
            torch.add(incoming[s % 2], chunks[(rank - s - 2) % n], out=target)
            pending = [] if last else step(s + 1, target)

    return p2p.P2PWork([], finish)

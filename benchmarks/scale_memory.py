"""Per-rank memory measurement for ``bench_scale.py``: an RSS sampler with phase labels, and the floor.

The sampler reads this process's resident set size from ``/proc/self/statm`` every ``interval_s`` on a
daemon thread, tagging each sample with the phase the training thread last announced (``set_phase``).
Torch's big kernels and gloo's waits release the GIL, so the thread keeps sampling through them. The exact
peak comes from the kernel instead (``VmHWM``, ``fullshard.testing.memory``), so a spike shorter than the
interval still counts.

RSS shows frees only if the allocator gives memory back: run with ``MALLOC_MMAP_THRESHOLD_=131072`` so
that every tensor above 128 KiB is its own ``mmap`` and is unmapped when freed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import nn

from fullshard.testing.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

# One reading of RSS and its peak for every benchmark and test (see [Note: which peak] there).
reset_peak = reset_peak_rss
__all__ = ["RssSampler", "peak_rss_bytes", "reset_peak", "rss_bytes"]


class RssSampler:
    """Samples (seconds since start, RSS bytes, phase) until stopped."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.phase = "idle"
        self.samples: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.perf_counter()

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.samples.append((time.perf_counter() - self.t0, rss_bytes(), phase))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, rss_bytes(), self.phase))
            time.sleep(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


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

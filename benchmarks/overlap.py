"""How much of a step's all-gather and reduce-scatter time runs under compute, from a ``torch.profiler`` trace.

On a GPU the collectives are NCCL kernels on their own stream: a kernel whose name holds ``nccl`` and
``AllGather`` or ``ReduceScatter`` is communication, every other kernel (matmuls, copies, the optimizer's) is
compute, and the hidden fraction is the time covered by both over the time covered by communication. On CPU
(gloo) the collectives are the ``c10d::`` calls that all-gather, reduce-scatter, send or receive (fullshard
gathers pairwise with sends on gloo), and compute is every ``aten::`` op not called from one of them; gloo
runs its transfers inside those calls, so the fraction there is near 0 and only shows that the path works.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Interval = tuple[float, float]

_GPU_COMM = ("allgather", "reducescatter")
_CPU_COMM = ("allgather", "all_gather", "reduce_scatter", "send", "recv")


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged: sorted, disjoint, covering the same time."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(a: list[Interval], b: list[Interval]) -> float:
    """The time two sorted, disjoint lists of intervals share."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def hidden_fraction(comm: Iterable[Interval], compute: Iterable[Interval]) -> tuple[float | None, float]:
    """(the fraction of communication time covered by compute, None without communication; that time)."""
    comm_union = union(comm)
    comm_time = sum(end - start for start, end in comm_union)
    if comm_time == 0:
        return None, 0.0
    return covered(comm_union, union(compute)) / comm_time, comm_time


def _is_cpu_comm(name: str) -> bool:
    return name.startswith("c10d::") and any(word in name.lower() for word in _CPU_COMM)


def split_events(events: Iterable[Any], on_gpu: bool) -> tuple[list[Interval], list[Interval]]:
    """(communication, compute) intervals in microseconds of a profiler's ``events()``."""
    from torch.autograd import DeviceType

    comm: list[Interval] = []
    compute: list[Interval] = []
    for event in events:
        span = (event.time_range.start, event.time_range.end)
        name = event.name
        if on_gpu:
            if event.device_type != DeviceType.CUDA:
                continue
            lowered = name.lower()
            if "nccl" in lowered:
                if any(word in lowered for word in _GPU_COMM):
                    comm.append(span)
            else:
                compute.append(span)
        elif event.device_type == DeviceType.CPU:
            if _is_cpu_comm(name):
                comm.append(span)
            elif name.startswith("aten::") and not _called_from_comm(event):
                compute.append(span)
    return comm, compute


def _called_from_comm(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _is_cpu_comm(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def measure(events: Iterable[Any], on_gpu: bool, steps: int) -> dict[str, float | None]:
    """``hidden``: all-gather and reduce-scatter time under compute over all of it (None: no such collective);
    ``comm_ms``: that time per step."""
    hidden, comm_us = hidden_fraction(*split_events(events, on_gpu))
    return {"hidden": hidden, "comm_ms": comm_us / 1e3 / steps}

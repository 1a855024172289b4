"""The collectives the engine issues, as free functions over flat buffers, with byte accounting.

Every function skips the collective when its group has one rank (the result is the input) and records
the bytes this rank sends and receives over the wire in :data:`COMM_STATS`, so that benchmarks can put the
measured traffic next to the theoretical figure. For a group of ``n`` ranks and an unsharded size of ``B``
bytes, ring algorithms move ``B * (n - 1) / n`` for an all-gather or a reduce-scatter and twice that for
an all-reduce; that is what is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["COMM_STATS", "CommStats", "all_gather_flat", "all_reduce_flat", "reduce_scatter_flat"]


@dataclass
class CommStats:
    """Bytes moved per kind of collective since the last :meth:`reset`, and how many were issued."""

    bytes: dict[str, int] = field(default_factory=lambda: {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0})
    calls: dict[str, int] = field(default_factory=lambda: {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0})

    wait_s: dict[str, float] = field(default_factory=lambda: {"all_gather": 0.0, "reduce_scatter": 0.0})

    def add_wait(self, kind: str, seconds: float) -> None:
        """Time the compute thread spent blocked waiting for a collective: communication not hidden."""
        self.wait_s[kind] += seconds

    def add(self, kind: str, nbytes: float) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    def reset(self) -> None:
        for kind in self.bytes:
            self.bytes[kind] = 0
            self.calls[kind] = 0
        for kind in self.wait_s:
            self.wait_s[kind] = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


COMM_STATS = CommStats()

# torch 2.13 renamed the flat collectives; older releases (2.11 on some GPU machines) have the old names only.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _size(pg: dist.ProcessGroup | None) -> int:
    return 1 if pg is None else dist.get_world_size(pg)


def all_gather_flat(
    output: torch.Tensor, shard: torch.Tensor, pg: dist.ProcessGroup | None, *, async_op: bool
) -> dist.Work | None:
    """``output`` (1D, ``n * shard.numel()``) receives every rank's ``shard`` (1D) in rank order."""
    n = _size(pg)
    if n == 1:
        output.copy_(shard)
        return None
    COMM_STATS.add("all_gather", output.numel() * output.element_size() * (n - 1) / n)
    return _all_gather_single(output, shard, group=pg, async_op=async_op)


def reduce_scatter_flat(
    output: torch.Tensor,
    full: torch.Tensor,
    pg: dist.ProcessGroup | None,
    *,
    async_op: bool,
    scratch_input: bool = False,
) -> dist.Work | _ChunkOfAllReduce | None:
    """``output`` (1D) receives the sum over ranks of this rank's chunk of ``full`` (1D, ``n`` chunks).

    ``scratch_input``: the caller gives ``full`` up (its contents are undefined afterwards). On gloo, whose
    reduce-scatter clones its input, all-reduces the clone and copies one chunk out, ``full`` is then
    all-reduced in place instead: the same bytes on the wire and the same sums bit for bit, without the
    full-size clone that would otherwise live as long as the returned work (see :class:`_ChunkOfAllReduce`).
    """
    n = _size(pg)
    if n == 1:
        output.copy_(full)
        return None
    COMM_STATS.add("reduce_scatter", full.numel() * full.element_size() * (n - 1) / n)
    if scratch_input and dist.get_backend(pg) == "gloo":
        work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        pending = _ChunkOfAllReduce(work, full, output, dist.get_rank(pg), n)
        if not async_op:
            pending.wait()
            return None
        return pending
    return _reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=pg, async_op=async_op)


class _ChunkOfAllReduce:
    """A reduce-scatter done as an in-place all-reduce: ``wait()`` waits, then copies this rank's chunk.

    Invariant: ``output`` holds the reduced chunk once ``wait()`` returns; the full buffer is released then.
    """

    def __init__(self, work: dist.Work, full: torch.Tensor, output: torch.Tensor, rank: int, n: int) -> None:
        self._work: dist.Work | None = work
        self._full: torch.Tensor | None = full
        self._output, self._rank, self._n = output, rank, n

    def wait(self) -> bool:
        if self._work is not None and self._full is not None:
            self._work.wait()
            self._output.copy_(self._full.view(self._n, -1)[self._rank])
            self._work, self._full = None, None
        return True


def all_reduce_flat(tensor: torch.Tensor, pg: dist.ProcessGroup | None, *, async_op: bool) -> dist.Work | None:
    """Sum ``tensor`` over the ranks of ``pg`` in place."""
    n = _size(pg)
    if n == 1:
        return None
    COMM_STATS.add("all_reduce", 2 * tensor.numel() * tensor.element_size() * (n - 1) / n)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=pg, async_op=async_op)

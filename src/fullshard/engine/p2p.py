"""Reduce-scatter and all-gather over gloo's point-to-point sends, for when gloo's own collectives are slower.

torch's gloo backend (2.13) has no reduce-scatter of its own: ``reduce_scatter_tensor`` clones the input,
all-reduces the whole clone and copies this rank's chunk out. An all-reduce moves ``2 B (n-1)/n`` bytes per
rank for an input of ``B`` bytes, twice a reduce-scatter's ``B (n-1)/n``, and the clone and copy add two
passes over memory. ``all_gather_into_tensor`` runs gloo's all-gather into a temporary and copies it into the
output chunks. Two algorithms over ``ProcessGroup.send`` / ``recv`` (asynchronous in gloo: the transfer
runs on gloo's I/O thread while the caller goes on) do the same job with the minimum traffic:

- **pairwise** (:func:`pairwise_reduce_scatter`, :func:`pairwise_all_gather`): every rank sends chunk ``j``
  straight to rank ``j`` and receives its own chunk from every other rank, all at once: one round of
  latency, ``B (n-1)/n`` bytes. All transfers are posted when the call returns; ``wait()`` waits for them
  and, for a reduce-scatter, sums the received chunks. The all-gather receives directly into the output.
- **ring** (:func:`ring_reduce_scatter`): ``n - 1`` steps, each sending one partial sum to the right-hand
  neighbour: the same bytes, ``n - 1`` rounds of latency, one chunk of receive buffer. Each step needs the
  previous one's result, so only the first step is posted by the call and ``wait()`` runs the rest: the
  later steps do not overlap with the caller's compute. For ``n == 2`` it is the pairwise algorithm.

Summation order (why results can differ from gloo's in the last bit): the pairwise reduce-scatter adds the
``n`` contributions in rank order, ``((c0 + c1) + c2) + ...``; the ring adds them starting at the rank after
the owner; gloo's all-reduce uses its own order, which depends on where the element sits in gloo's
segmentation of the buffer (measured at 4 ranks, where the segments line up with the chunks: rank ``r``'s
chunk is ``((c[r+2] + c[r+3]) + c[r+1]) + c[r]``). For ``n == 2`` every order is ``a + b == b + a`` (IEEE
addition commutes), so all three agree bitwise; for ``n >= 3`` they agree up to rounding (floating-point
addition does not associate). Each add rounds to the tensor's dtype, as gloo's reduction does (bf16 too).

Invariants: ranks must call these functions in the same order with the same sizes (as for any collective);
messages between two ranks on one tag are matched first-in first-out, so several calls may be in flight at
once. The input of a reduce-scatter and the output of an all-gather must stay alive and unmodified until
``wait()`` returns. Every call returns a handle whose ``wait()`` completes the operation (idempotent).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["ALL_GATHER_TAG", "REDUCE_SCATTER_TAG", "P2PWork", "pairwise_all_gather", "pairwise_reduce_scatter"]
__all__ += ["ring_reduce_scatter"]

# Tags well below gloo's collective slots (those carry a prefix in the top byte); one per kind so that an
# all-gather and a reduce-scatter in flight together never match each other's messages.
REDUCE_SCATTER_TAG = 0x5EA1
ALL_GATHER_TAG = 0x5EA2


class P2PWork:
    """A ``dist.Work``-like handle: ``wait()`` waits for the posted transfers, then runs ``finish``.

    ``finish`` may post and wait for more transfers (the ring's later steps). ``wait`` runs it once; later
    calls return at once.
    """

    def __init__(self, works: list[dist.Work], finish: Callable[[], None] | None = None) -> None:
        self._works = works
        self._finish = finish
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done:
            return True
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        if self._finish is not None:
            self._finish()
        self._works, self._finish, self._done = [], None, True
        return True

    def is_completed(self) -> bool:
        return self._done


def _check(output: torch.Tensor, flat: torch.Tensor, n: int, what: str) -> int:
    if not (output.is_contiguous() and flat.is_contiguous()) or flat.numel() != n * output.numel():
        raise ValueError(
            f"{what}: needs contiguous 1D tensors with the full one {n} x the chunk; got chunk "
            f"{tuple(output.shape)} (contiguous={output.is_contiguous()}), full {tuple(flat.shape)} "
            f"(contiguous={flat.is_contiguous()})"
        )
    return output.numel()


def pairwise_reduce_scatter(output: torch.Tensor, full: torch.Tensor, pg: dist.ProcessGroup) -> P2PWork:
    """``output`` becomes the sum over ranks of chunk ``rank`` of ``full`` (``n`` equal chunks), rank order."""
    n, rank = pg.size(), pg.rank()
    chunks = full.view(n, _check(output, full, n, "pairwise_reduce_scatter"))
    received = torch.empty(n - 1, chunks.shape[1], dtype=full.dtype, device=full.device)
    works, rows = [], []
    for peer in range(n):
        if peer != rank:
            works.append(pg.send([chunks[peer]], peer, REDUCE_SCATTER_TAG))
    for peer in range(n):
        if peer == rank:
            rows.append(chunks[rank])
            continue
        row = received[peer if peer < rank else peer - 1]
        works.append(pg.recv([row], peer, REDUCE_SCATTER_TAG))
        rows.append(row)

    def finish() -> None:
        if n == 1:
            output.copy_(rows[0])
            return
        torch.add(rows[0], rows[1], out=output)
        for row in rows[2:]:
            output.add_(row)

    return P2PWork(works, finish)


def pairwise_all_gather(output: torch.Tensor, shard: torch.Tensor, pg: dist.ProcessGroup) -> P2PWork:
    """``output`` (``n`` chunks) receives every rank's ``shard`` in rank order, straight into place."""
    n, rank = pg.size(), pg.rank()
    chunks = output.view(n, _check(shard, output, n, "pairwise_all_gather"))
    works = [pg.send([shard], peer, ALL_GATHER_TAG) for peer in range(n) if peer != rank]
    works += [pg.recv([chunks[peer]], peer, ALL_GATHER_TAG) for peer in range(n) if peer != rank]
    chunks[rank].copy_(shard)
    return P2PWork(works)


def ring_reduce_scatter(output: torch.Tensor, full: torch.Tensor, pg: dist.ProcessGroup) -> P2PWork:
    """``output`` becomes the sum over ranks of chunk ``rank`` of ``full``, by ``n - 1`` ring steps.

    Step ``s`` sends the partial sum of chunk ``rank - s - 1`` to the right and receives the partial sum of
    chunk ``rank - s - 2`` from the left, to which this rank adds its own piece; after ``n - 1`` steps the
    partial sum received is chunk ``rank``'s complete sum.
    """
    n, rank = pg.size(), pg.rank()
    chunks = full.view(n, _check(output, full, n, "ring_reduce_scatter"))
    right, left = (rank + 1) % n, (rank - 1) % n
    # Two partial-sum buffers: one being sent while the next is received and summed into.
    partial = torch.empty(2, chunks.shape[1], dtype=full.dtype, device=full.device)
    incoming = torch.empty_like(partial)

    def step(s: int, outgoing: torch.Tensor) -> list[dist.Work]:
        return [
            pg.send([outgoing], right, REDUCE_SCATTER_TAG),
            pg.recv([incoming[s % 2]], left, REDUCE_SCATTER_TAG),
        ]

    if n == 1:
        output.copy_(chunks[0])
        return P2PWork([])
    first = step(0, chunks[(rank - 1) % n])

    def finish() -> None:
        pending = first
        for s in range(n - 1):
            for work in pending:
                work.wait()
            mine = chunks[(rank - s - 2) % n]
            last = s == n - 2
            target = output if last else partial[s % 2]
            torch.add(incoming[s % 2], mine, out=target)
            pending = [] if last else step(s + 1, target)

    return P2PWork([], finish)

"""Reduce-scatter and all-gather over gloo's point-to-point sends, and when the engine uses them.

torch's gloo backend (2.13) has no reduce-scatter: ``reduce_scatter_tensor`` clones the input, all-reduces
the whole clone and copies this rank's chunk out, ``2 B (n-1)/n`` bytes per rank over ``2 (n-1)`` rounds for
a ``B``-byte input; ``all_gather_into_tensor`` gathers into a temporary and copies. The pairwise versions
here post every transfer at once with ``ProcessGroup.send`` / ``recv`` (asynchronous in gloo: its I/O thread
moves the bytes while the caller computes): ``B (n-1)/n`` bytes, one round. ``wait()`` waits for them and, for a
reduce-scatter, adds the contributions in rank order ``((c0 + c1) + c2) + ...`` (on 2 ranks the peer's chunk is
received into the output and this rank's added). The all-gather receives in place.

Which one runs: :func:`use_p2p`, asked by ``engine/collectives.py`` before each collective; only gloo groups on
CPU tensors come here (NCCL and the rest keep their own), from the crossovers in :data:`P2P_MIN_BYTES` measured
by ``benchmarks/collectives.py``, or at every size where the payloads go through shared memory (``shm.py``: ranks
of one host). ``FULLSHARD_GLOO_P2P=0`` forces gloo's collectives, ``1`` the point-to-point ones, ``auto`` (or
unset) the measured choice; other values are refused by name.

Numerics: on 2 ranks the sum is one addition, which commutes, so results are bitwise gloo's. On 3 or more,
gloo adds in its own order (measured on 4 ranks, where its segments line up with the chunks: rank ``r``'s
chunk is ``((c[r+2] + c[r+3]) + c[r+1]) + c[r]``), so sums can differ in the last bit; neither order is that
of single-process training or of DDP's bucketed all-reduce. All-gathers are always bitwise.

Invariants: ranks call these in the same order with the same sizes, as for any collective; messages between
two ranks on one tag match first-in first-out, so several calls may be in flight at once. Inputs and outputs
stay alive and untouched until ``wait()`` returns (the engine holds them in its pending reductions and gathers).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from fullshard.engine import shm
from fullshard.engine.mesh import is_gloo

__all__ = ["ENV_VAR", "P2P_MIN_BYTES", "P2PWork", "pairwise_all_gather", "pairwise_reduce_scatter", "use_p2p"]

ENV_VAR = "FULLSHARD_GLOO_P2P"

# Smallest full-buffer size (bytes, all ranks' chunks) from which the point-to-point version beat gloo's, per
# (collective, group size); larger groups use the largest size measured. From benchmarks/collectives.py on the
# 2-core AMD EPYC machine, 2026-11-23, under load average 19-30 from other jobs (docs/benchmarks.md). 2 ranks:
# the pairwise reduce-scatter won at every size from 1 MB (0.30-0.81x gloo's time), the all-gather from 2 MB
# in fp32 (0.13-0.53x; bf16 tied at 2 and 5 MB); below, gloo won or the gap was noise. 4 ranks: from 1 MB the
# reduce-scatter won at 10 of 12 (size, dtype) points (median 0.67x; the losses, 2 MB fp32 and 10 MB bf16,
# did not recur at the same bytes in the other dtype), the all-gather at every point from 2 MB (0.14-0.78x).
P2P_MIN_BYTES: dict[tuple[str, int], int] = {
    ("reduce_scatter", 2): 1_000_000,
    ("reduce_scatter", 4): 1_000_000,
    ("all_gather", 2): 2_000_000,
    ("all_gather", 4): 2_000_000,
}

# Below gloo's collective slots (those carry a prefix in the top byte); one tag per kind, so that an
# all-gather and a reduce-scatter in flight together never take each other's messages.
REDUCE_SCATTER_TAG, ALL_GATHER_TAG = 0x5EA1, 0x5EA2

# While not None, the calls below append the bytes each sends to (and receives from) every other rank: what a
# waiting rank's messages are, for the check's watch to mirror (``collective_check.issue``, ``check_watch.py``).
recorded_sizes: list[int] | None = None


class P2PWork:
    """A ``dist.Work``-like handle: ``wait()`` waits for the posted transfers, then runs ``finish`` once."""

    def __init__(self, works: list[dist.Work], finish: Callable[[], None] | None = None) -> None:
        self._works, self._finish, self._done = works, finish, False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done:
            for work in self._works:
                work.wait() if timeout is None else work.wait(timeout)
            if self._finish is not None:
                self._finish()
            self._works, self._finish, self._done = [], None, True
        return True

    def is_completed(self) -> bool:
        return self._done


def _chunk_numel(chunk: torch.Tensor, full: torch.Tensor, n: int, what: str) -> int:
    if not (chunk.is_contiguous() and full.is_contiguous()) or full.numel() != n * chunk.numel():
        raise ValueError(
            f"{what}: needs contiguous tensors, the full one {n} x the chunk; got chunk {tuple(chunk.shape)} "
            f"(contiguous={chunk.is_contiguous()}), full {tuple(full.shape)} (contiguous={full.is_contiguous()})"
        )
    return chunk.numel()


def pairwise_reduce_scatter(
    output: torch.Tensor, full: torch.Tensor, pg: dist.ProcessGroup, tag: int = REDUCE_SCATTER_TAG
) -> P2PWork:
    """``output`` becomes the rank-order sum over ranks of chunk ``rank`` of ``full`` (``n`` equal chunks), sent on
    ``tag``."""
    n, rank = pg.size(), pg.rank()
    chunks = full.view(n, _chunk_numel(output, full, n, "pairwise_reduce_scatter"))
    ch = shm.channel(pg, output.numel() * output.element_size(), full.device)
    if ch is not None:  # ranks on one host: through shared memory, a header each way on gloo (shm.py)
        if recorded_sizes is not None:
            recorded_sizes.append(shm.HEADER_BYTES)
        return P2PWork(*shm.reduce_scatter(ch, output, full, pg, tag))
    if recorded_sizes is not None:
        recorded_sizes.append(output.numel() * output.element_size())
    if n == 2:  # the peer's chunk lands in output and ours is added: one addition, which commutes; no buffer
        peer = 1 - rank
        works = [pg.send([chunks[peer]], peer, tag), pg.recv([output], peer, tag)]
        return P2PWork(works, lambda: output.add_(chunks[rank]))
    received = torch.empty(max(n - 1, 0), chunks.shape[1], dtype=full.dtype, device=full.device)
    works = [pg.send([chunks[peer]], peer, tag) for peer in range(n) if peer != rank]
    rows = [chunks[rank] if peer == rank else received[peer - (peer > rank)] for peer in range(n)]
    works += [pg.recv([rows[peer]], peer, tag) for peer in range(n) if peer != rank]

    def finish() -> None:
        if n == 1:
            output.copy_(rows[0])
            return
        torch.add(rows[0], rows[1], out=output)
        for row in rows[2:]:
            output.add_(row)

    return P2PWork(works, finish)


def pairwise_all_gather(
    output: torch.Tensor, shard: torch.Tensor, pg: dist.ProcessGroup, tag: int = ALL_GATHER_TAG
) -> P2PWork:
    """``output`` (``n`` chunks) receives every rank's ``shard`` in rank order, straight into place, sent on ``tag``."""
    n, rank = pg.size(), pg.rank()
    chunks = output.view(n, _chunk_numel(shard, output, n, "pairwise_all_gather"))
    ch = shm.channel(pg, shard.numel() * shard.element_size(), shard.device)
    if ch is not None:
        if recorded_sizes is not None:
            recorded_sizes.append(shm.HEADER_BYTES)
        return P2PWork(*shm.all_gather(ch, output, shard, pg, tag))
    if recorded_sizes is not None:
        recorded_sizes.append(shard.numel() * shard.element_size())
    works = [pg.send([shard], peer, tag) for peer in range(n) if peer != rank]
    works += [pg.recv([chunks[peer]], peer, tag) for peer in range(n) if peer != rank]
    chunks[rank].copy_(shard)
    return P2PWork(works)


def _forced() -> bool | None:
    value = os.environ.get(ENV_VAR, "auto").strip().lower()
    if value in ("0", "1"):
        return value == "1"
    if value not in ("", "auto"):
        raise ValueError(f"{ENV_VAR}={value!r}: expected 0 (gloo's collectives), 1 (point-to-point) or auto")
    return None


def use_p2p(kind: str, pg: dist.ProcessGroup | None, full: torch.Tensor) -> bool:
    """Whether the ``kind`` collective of ``full`` (the unsharded buffer) over ``pg`` goes point-to-point."""
    if pg is None or full.device.type != "cpu" or not is_gloo(pg):
        return False
    forced = _forced()
    if forced is not None:
        return forced
    if shm.channel(pg, full.numel() * full.element_size() // pg.size(), full.device) is not None:
        return True  # through shared memory, faster than gloo's collectives at every size
    measured = [size for k, size in P2P_MIN_BYTES if k == kind and size <= pg.size()]
    return bool(measured) and full.numel() * full.element_size() >= P2P_MIN_BYTES[(kind, max(measured))]

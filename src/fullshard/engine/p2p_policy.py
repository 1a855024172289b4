"""When the engine's reduce-scatters and all-gathers go over point-to-point sends instead of gloo's collectives.

:mod:`fullshard.engine.collectives` asks :func:`use_p2p` before each collective. Only gloo process groups on
CPU tensors are ever routed to :mod:`fullshard.engine.p2p`: NCCL and every other backend keep their native
collectives. On gloo the choice is per (collective, group size, full-buffer bytes), from the crossovers in
:data:`P2P_MIN_BYTES`, which were measured with ``benchmarks/bench_collectives.py`` (see
``docs/benchmarks.md``).

``FULLSHARD_GLOO_P2P`` overrides the measured choice: ``0`` always uses gloo's collectives (the summation
order of torch's gloo backend, bit for bit), ``1`` always uses the point-to-point ones, unset or ``auto``
follows the measurements. Any other value is refused by name at the first collective.

Numerics: with 2 ranks the result is bitwise the native one (one addition, which commutes). With 3 or more
the point-to-point reduce-scatter adds contributions in rank order, gloo in its own ring order, so the sums
can differ in the last bit; neither is the order of single-process training or of DDP's bucketed
all-reduce. The all-gather only moves bytes: always bitwise equal.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fullshard.engine import p2p

__all__ = ["ENV_VAR", "P2P_MIN_BYTES", "all_gather", "reduce_scatter", "use_p2p"]

ENV_VAR = "FULLSHARD_GLOO_P2P"

# Smallest full-buffer size (bytes, all ranks' chunks together) from which the point-to-point algorithm beat
# gloo's collective, per (collective, group size); groups larger than the largest size measured use its entry.
# Chosen from bench_collectives.py (see docs/benchmarks.md for the table and the load it ran under).
P2P_MIN_BYTES: dict[tuple[str, int], int] = {
    ("reduce_scatter", 2): 0,
    ("reduce_scatter", 4): 0,
    ("all_gather", 2): 0,
    ("all_gather", 4): 0,
}

_backends: dict[int, bool] = {}  # id(process group) -> is it plain gloo


def _forced() -> bool | None:
    value = os.environ.get(ENV_VAR, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"{ENV_VAR}={value!r}: expected 0 (gloo's collectives), 1 (point-to-point) or auto (measured)")


def _is_gloo(pg: dist.ProcessGroup) -> bool:
    key = id(pg)
    if key not in _backends:
        _backends[key] = dist.get_backend(pg) == "gloo"
    return _backends[key]


def use_p2p(kind: str, pg: dist.ProcessGroup | None, full: torch.Tensor) -> bool:
    """Whether the ``kind`` collective of ``full`` (the unsharded buffer) over ``pg`` goes point-to-point."""
    if pg is None or full.device.type != "cpu" or not _is_gloo(pg):
        return False
    forced = _forced()
    if forced is not None:
        return forced
    n = pg.size()
    measured = [size for (k, size) in P2P_MIN_BYTES if k == kind and size <= n]
    if not measured:
        return False
    threshold = P2P_MIN_BYTES[(kind, max(measured))]
    return full.numel() * full.element_size() >= threshold


def _finish(work: p2p.P2PWork, async_op: bool) -> p2p.P2PWork | None:
    """As torch's collectives: a handle when asynchronous, else complete before returning."""
    if async_op:
        return work
    work.wait()
    return None


def reduce_scatter(
    output: torch.Tensor, full: torch.Tensor, pg: dist.ProcessGroup, *, async_op: bool
) -> p2p.P2PWork | None:
    return _finish(p2p.pairwise_reduce_scatter(output, full, pg), async_op)


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, pg: dist.ProcessGroup, *, async_op: bool
) -> p2p.P2PWork | None:
    return _finish(p2p.pairwise_all_gather(output, shard, pg), async_op)

"""Profiler labels for the engine's phases, so a ``torch.profiler`` trace shows where a step's time went.

Each phase body runs inside ``with phase(NAME):``, a ``torch.profiler.record_function`` range: with no
profiler running it costs two cheap dispatcher calls and records nothing. Ranges nest (``PRE_FORWARD``
holds ``ALL_GATHER``, ``ALL_GATHER_WAIT`` and ``COPY_OUT``); the *leaf* ranges that block the compute
thread on communication or move bytes, ``ALL_GATHER_WAIT``, ``REDUCE_WAIT``, ``COPY_OUT`` and ``COPY_IN``,
never nest inside one another, so their times add up (``benchmarks/train.py steps --trace``).

Invariant: one range per occurrence of a phase that does work; calls that return at once (a unit already
gathered, nothing to reduce) open no range, so counts in ``prof.key_averages()`` count real work.
"""

from __future__ import annotations

from torch.profiler import record_function

__all__ = ["LABELS", "phase"]

PRE_FORWARD = "fullshard::pre_forward"
"""A unit's pre-forward hook: lazy init on the first call, gather (issue, wait, copy-out), forward prefetch."""
POST_FORWARD = "fullshard::post_forward"
"""A unit's post-forward hook: reshard (or expose the sharded parameters), register the pre-backward hooks."""
PRE_BACKWARD = "fullshard::pre_backward"
"""A unit's first pre-backward per backward: gather again if freed, backward prefetch."""
POST_BACKWARD = "fullshard::post_backward"
"""A unit's post-backward (all its gradients ready): issue the reduction, wait for the oldest beyond two in
flight, reshard, prefetch."""
FINAL_CALLBACK = "fullshard::final_callback"
"""The root's end-of-backward callback: reduce units with no gradient, wait for every reduction, reshard."""
ALL_GATHER = "fullshard::all_gather"
"""Issuing a unit's asynchronous all-gathers (and the cast/copy of the shard to the compute device)."""
ALL_GATHER_WAIT = "fullshard::all_gather_wait"
"""Blocked until a unit's all-gathers complete: the all-gather time not hidden behind compute."""
COPY_OUT = "fullshard::copy_out"
"""Copying the packed parameters from the rank-major all-gather output into their full blocks."""
RESHARD = "fullshard::reshard"
"""Registering the sharded parameters again and freeing the gathered storage."""
REDUCE_SCATTER = "fullshard::reduce_scatter"
"""Issuing a unit's gradient reduction (reduce-scatter, or all-reduce with one rank per shard group, or
the communication hook, which runs synchronously)."""
COPY_IN = "fullshard::copy_in"
"""Reordering the packed gradients rank-major for the reduce-scatter (inside ``REDUCE_SCATTER``)."""
REDUCE_WAIT = "fullshard::reduce_wait"
"""Blocked until one started reduction completes, plus the synchronous all-reduce across replicas
(hybrid sharding): the reduction time not hidden behind compute."""

LABELS = (
    PRE_FORWARD,
    POST_FORWARD,
    PRE_BACKWARD,
    POST_BACKWARD,
    FINAL_CALLBACK,
    ALL_GATHER,
    ALL_GATHER_WAIT,
    COPY_OUT,
    RESHARD,
    REDUCE_SCATTER,
    COPY_IN,
    REDUCE_WAIT,
)


def phase(name: str) -> record_function:
    """A profiler range named ``name`` (one of :data:`LABELS`), to be used as a ``with`` block."""
    return record_function(name)

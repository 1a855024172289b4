"""Muon's whole-parameter step pipelined: gather, step and scatter one owner slot after another, the exchange in
the background (``WholeParamStep`` mixes in :class:`PipelinedSteps`).

[Note: pipelined whole steps]
In [Note: whole-parameter steps] (``whole_step.py``) the exchange and the step follow each other: every gather, then
every matrix's Newton-Schulz, then every scatter, each rank waiting in each all-to-all for the slowest one. For
``torch.optim.Muon`` (exactly that class: its step is the same computed one parameter at a time, with no state but
each parameter's ``momentum_buffer``) the pre-hook pipelines them once every rank knows the state's kinds (from the
second step), on a 1-D shard group with dim-0 rows. It posts the gathers (``async_op``, the calls of [Note: exchange
memory], into the whole tensors) of the first two owner slots and wraps them in whole parameters; then for owner
slot ``j`` it waits for that slot's pieces, posts the gathers of slot ``j + 2``, runs the optimizer's own ``step``
(its undecorated function, without its hooks) with only the owner's ``j``-th whole parameter in its param group, and
posts slot ``j``'s scatter at once (the owner's whole tensors are freed as soon as their bytes are copied into the
send buffers). At most two posted scatters are unfinished; the post-hook finishes the rest. The gathers of later
slots and the scatters of earlier ones move while Newton-Schulz runs, a rank waits only where its next slot's bytes
have not come, and an owner holds about four of its matrices whole at a time (two gathering, one stepping, one being
sent) instead of all of them. The kernels and their inputs are those of the unsharded step (one parameter per call,
as Muon loops over them anyway), so it is bitwise the same; other optimizers (whose state may span parameters: a
step counter per call, a shared preconditioner) keep the sequence of [Note: whole-parameter steps] in
``whole_step.py``. Where Muon's state is its momentum alone (``torch.optim.Muon`` as it is), ``_pipeline`` hands
the bucket to the split step instead (``whole_muon.py``, [Note: split Muon steps]: only Newton-Schulz's bf16
input and output travel); what follows here is then the path of a Muon whose state holds more.

The class reads, and does not set up, ``WholeParamStep``'s ``optimizer``, ``_specs``, ``_known`` and ``_position``,
and calls its exchange (``_post_gather``, ``_own_whole``, ``_post_scatter``, ``_finish_scatter``) and state
(``_rest_spec``, ``_piece_dtypes``) methods, which stay in ``whole_step.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fullshard.algorithms.whole_owners import Bucket, Entry
from fullshard.algorithms.whole_pieces import may_change, whole_spec

__all__ = ["PipelinedSteps"]

# pipelined steps: owner slots whose gathers run ahead of the one being stepped, and posted scatters left unfinished
_AHEAD = 2


class PipelinedSteps:
    """``WholeParamStep``'s pipelined path; see [Note: pipelined whole steps]."""

    def _can_pipeline(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` can be stepped slot by slot (see [Note: pipelined whole steps]): an optimizer whose
        step is the same one parameter at a time (Muon: no state but each parameter's), state of known kinds,
        plain dim-0 rows on a 1-D shard group."""
        if type(self.optimizer) is not getattr(torch.optim, "Muon", None) or bucket.world == 1:
            return False
        if not hasattr(type(self.optimizer).step, "__wrapped__"):  # no step without its hooks to call per matrix
            return False
        stepping = [e for e in bucket.entries if e.param.grad is not None]
        return all(
            e.sp.shard_dim == 0
            and e.sp.tp is None
            and id(e.param) in self._known
            and not may_change(self._specs.get(id(e.param), []))
            for e in stepping
        )

    def _pipeline(self, bucket: Bucket) -> None:
        """Per owner slot: wait for its pieces, post the gathers of the slot ``_AHEAD`` further, step the owner's
        matrix alone, post its scatter; the post-hook finishes the scatters (see [Note: pipelined whole steps])."""
        bucket.stepping = [e for e in bucket.entries if e.param.grad is not None]
        for e in bucket.stepping:
            self._specs[id(e.param)] = self._rest_spec(e)
        if self._can_split(bucket):  # Muon's own state alone: only Newton-Schulz's input and output travel
            self._split_step(bucket)
            bucket.stepping = []
            return
        dtypes = {id(e.param): self._piece_dtypes(e) for e in bucket.stepping}
        owned = [[e for e in bucket.stepping if e.owner == o] for o in range(bucket.world)]
        slots = max((len(es) for es in owned), default=0)
        me = bucket.rank
        mine = [owned[me][j] if j < len(owned[me]) else None for j in range(slots)]
        gathers: list[list[Any]] = [[] for _ in range(slots)]  # per slot: its all_to_all works

        def post(first: int, last: int) -> None:  # the gathers of slots first..last-1, in the background
            wholes = self._post_gather(bucket, owned, dtypes, first, last, gathers)
            for j in range(first, last):
                e = mine[j]
                if e is not None:  # the whole tensors as they will be once received (dim 0, no tp: plain views)
                    self._own_whole(e, wholes[j])

        post(0, min(_AHEAD, slots))
        bucket.scatters = []
        for j in range(slots):
            for work in gathers[j]:
                work.wait()
            gathers[j] = []  # its send buffers
            if j + _AHEAD < slots:
                post(j + _AHEAD, j + _AHEAD + 1)
            e = mine[j]
            state: dict[str, Any] = {}
            if e is not None:
                self._step_alone(e)
                state = self.optimizer.state.pop(e.whole, {})
                if whole_spec(e, state) != self._specs[id(e.param)]:
                    raise RuntimeError(
                        f"[rank {dist.get_rank()}] whole_param_step: the optimizer changed the state names of "
                        f"{e.fqn!r} after its first step; whole-parameter steps need a state that keeps its names "
                        "and shapes once created. Create every state at the first step."
                    )
            slot = {o: es[j] for o, es in enumerate(owned) if j < len(es)}
            bucket.scatters.append(self._post_scatter(bucket, slot, state))
            del state
            if len(bucket.scatters) > _AHEAD:  # bounded: the bytes of _AHEAD slots in flight
                self._finish_scatter(bucket.scatters.pop(0))

    def _step_alone(self, e: Entry) -> None:
        """The optimizer's own step (without its hooks) on ``e``'s whole parameter alone, in its param group."""
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        try:
            for group in groups:
                group["params"] = []
            groups[self._position[id(e.param)][0]]["params"] = [e.whole]
            with torch.no_grad():
                type(self.optimizer).step.__wrapped__(self.optimizer)
        finally:
            for group, params in zip(groups, saved, strict=True):
                group["params"] = params

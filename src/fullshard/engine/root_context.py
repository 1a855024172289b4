"""What a root unit shares with every unit below it for one model, and the gather decisions drawn from it.

``RootContext`` holds the recorded forward order (``ForwardOrder``), the backward pass under way
(``BackwardPass``: the root's final callback, the reductions in flight), the spare memory a freed unit keeps for
the next gather, and how many non-root units hold gathered parameters. The functions below decide, from that
shared state, what to prefetch (``prefetch``, ``prefetch_backward``: nothing once this iteration departs from the
recorded order, nothing while two non-root units are gathered under ``limit_all_gathers``), whether a unit keeps
its freed memory for the next gather (``next_gather_fits``) and which units to free after the root's forward
(``reshard_leftovers``). See [Note: one iteration] in ``unit_state.py`` for when each runs.

The units here are ``UnitState``s (``unit_state.py``), typed ``Any``: ``unit_state`` imports this module, so it
cannot be imported here. Of a unit this module reads ``group``, ``config``, ``no_backward`` and, through
``ForwardOrder``, its identity; it sets nothing on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd import Variable

from fullshard.engine.group import ParamGroup, ShardState
from fullshard.engine.spare import SpareStorage

__all__ = [
    "BackwardPass",
    "ForwardOrder",
    "RootContext",
    "next_gather_fits",
    "prefetch",
    "prefetch_backward",
    "reshard_leftovers",
]


@dataclass
class ForwardOrder:
    """The order units ran forward in the first iteration (frozen after it), and this iteration's progress
    against it: prefetching follows the recorded order and stops at the first difference.

    Two orders are recorded: of pre-forwards (``units``: what forward gathers next) and of post-forwards
    (``finished``: its reverse is the order units begin backward in). They differ where units nest: a decoder
    layer's unit begins forward before the projections inside it and ends after them, so in backward it comes
    first and they follow, and the unit to prefetch after the layer is its last projection, not the unit that
    ran forward before the layer (the previous layer's last projection, needed a whole layer later)."""

    units: list[Any] = field(default_factory=list)
    finished: list[Any] = field(default_factory=list)  # in the order their forwards ended
    frozen: bool = False
    cursor: int = 0  # units run forward so far this iteration
    changed: bool = False
    this_iteration: list[str] = field(default_factory=list)  # labels, for the cross-rank check
    position: dict[int, int] = field(default_factory=dict)  # id(state) -> first index in units
    finished_position: dict[int, int] = field(default_factory=dict)  # id(state) -> last index in finished

    def start_iteration(self) -> None:  # at the root's pre-forward
        self.cursor = 0
        self.this_iteration.clear()
        if not self.frozen:
            self.units.clear()
            self.finished.clear()

    def freeze(self) -> None:
        self.frozen = True
        for i, state in enumerate(self.units):
            self.position.setdefault(id(state), i)
        for i, state in enumerate(self.finished):
            self.finished_position[id(state)] = i

    def next(self, state: Any, step: int) -> Any:
        """The unit that runs after ``state``: in forward (``step`` 1) the next pre-forward recorded, in backward
        (``step`` -1) the unit whose forward ended just before ``state``'s."""
        units, position = (self.units, self.position) if step > 0 else (self.finished, self.finished_position)
        i = position.get(id(state))
        if i is None or not 0 <= i + step < len(units):
            return None
        return units[i + step]


@dataclass
class BackwardPass:
    """Bookkeeping of the backward pass under way: the root's final callback, and the reductions in flight."""

    in_backward: bool = False  # the root's final callback is queued and has not run yet
    in_flight: list[ParamGroup] = field(default_factory=list)

    def begin(self, final_callback: Callable[[], None]) -> None:
        """At the first pre-backward of a backward pass: queue the root's final callback once."""
        if not self.in_backward:
            self.in_backward = True
            Variable._execution_engine.queue_callback(final_callback)

    def settle(self, limit: int) -> None:
        """Finish the oldest reductions until at most ``limit`` are left in flight."""
        while len(self.in_flight) > limit:
            self.in_flight.pop(0).finish_reduce()

    def end(self) -> None:
        self.in_flight.clear()
        self.in_backward = False


@dataclass
class RootContext:
    """What the root unit shares with every unit below it for one model."""

    root: Any
    states: list[Any]
    order: ForwardOrder = field(default_factory=ForwardOrder)
    backward: BackwardPass = field(default_factory=BackwardPass)
    spare: SpareStorage = field(default_factory=SpareStorage)  # a freed unit's memory, for the next gather
    gathered: int = 0  # units other than the root holding gathered (or gathering) parameters now
    max_gathered: int = 0  # most non-root units gathered at once (limit_all_gathers keeps it at 2)

    def note_gathered(self) -> None:
        self.max_gathered = max(self.max_gathered, self.gathered)


def next_gather_fits(ctx: RootContext, state: Any, step: int) -> bool:
    """Whether the next unit to gather after ``state`` (the first still-sharded one in the recorded order, 1 in
    forward, -1 in backward) gathers as many bytes on the same device: ``state`` then keeps its freed
    memory for it (see ``spare.py``). Not before the order is recorded, nor when this iteration departs from it."""
    if state.group is None or not ctx.order.frozen or ctx.order.changed:
        return False
    nearest = ctx.order.next(state, step)
    if nearest is not None and nearest.group is not None and nearest.group.state is not ShardState.SHARDED:
        nearest = ctx.order.next(nearest, step)  # gathered already (prefetched, or the root): the one after
    if step < 0 and nearest is not None and nearest.no_backward:
        return False  # it will not be gathered for backward (see prefetch_backward)
    other = nearest.group if nearest is not None else None
    mine = (state.group.full_nbytes, state.group.device)
    return other is not None and other.state is ShardState.SHARDED and (other.full_nbytes, other.device) == mine


def prefetch(ctx: RootContext, state: Any) -> None:
    """Start gathering ``state``'s parameters, unless gathered already or the rate limit is reached."""
    if state is None or state.group is None or state.group.state is not ShardState.SHARDED:
        return
    if state.config.limit_all_gathers and ctx.gathered >= 2:
        return
    state.group.unshard()


def prefetch_backward(ctx: RootContext, state: Any) -> None:
    """Prefetch the unit that runs backward after ``state`` (the one whose forward ended just before), unless it has no
    backward this iteration (``UnitState.no_backward``: a frozen embedding fed token ids; torch's FSDP2 skips such a
    unit too): it would stay gathered, unused, to the end of backward."""
    if not ctx.order.changed:
        target = ctx.order.next(state, -1)
        if target is not None and not target.no_backward:
            prefetch(ctx, target)
        ctx.note_gathered()


def reshard_leftovers(ctx: RootContext) -> None:
    """After the root's forward: free units that should be free (e.g. prefetched but never run)."""
    for state in ctx.states:
        if state is ctx.root or state.group is None or state.group.state is ShardState.SHARDED:
            continue
        if state.config.reshard_after_forward or not torch.is_grad_enabled():
            state.group.reshard()

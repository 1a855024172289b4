"""Optimizer steps on whole parameters (Muon, Adafactor, a user's Shampoo) while everything stays sharded at rest.

This module holds the hooks (``WholeParamStep``) and the serial exchange; beside it, ``whole_owners.py`` (the
parameters by shard group, and who steps each), ``whole_pieces.py`` (a parameter's state kinds and its pieces as
bytes) and ``whole_pipeline.py`` (Muon's exchange pipelined, mixed into ``WholeParamStep``).

[Note: whole-parameter steps]
A matrix optimizer computes on each parameter as a whole: Muon orthogonalises the momentum of the full matrix,
Adafactor keeps row and column statistics and scales by the parameter's norm. Run on a rank's rows only, it
computes something else (Muon) or fails (Adafactor on DTensors). :func:`whole_param_step` hooks one optimizer
so that each of its sharded parameters is stepped whole, by one rank:

- **Owners.** Each sharded parameter gets one owner among its shard group's ranks, costliest first, each to the
  rank with the least cost so far (the same answer on every rank: it depends on shapes only). The cost is the
  step's work: for Muon the Newton-Schulz FLOPs of the matrix (``m * n * min(m, n)``: a square matrix costs more
  per element than a long one), for other optimizers its elements.
- **Before the step** (a step pre-hook), ``all_to_all_single`` per shard group (one per piece and owner slot)
  sends every owner the rows the other ranks hold of its parameters: the parameter, its gradient and its per-element
  states. The owner puts them together (a byte copy: nothing is computed) into a plain whole ``nn.Parameter``
  with its whole gradient and whole state, and swaps it into the optimizer's param groups in the sharded one's
  place; other ranks take the parameter out of their groups for this step.
- **The step** is the optimizer's own, unchanged, on whole tensors: the same kernels on the same inputs as the
  unsharded run, so its results are bitwise the unsharded run's whenever the gradients are (by construction,
  on any CPU; the gradients are bitwise equal in world-size-invariant mode).
- **After the step** (a post-hook), ``all_to_all_single`` again (one per owner slot and piece) sends each rank
  its rows of the updated
  parameter and per-element states, and every rank the owner's other state (0-dim ``step`` counters,
  Adafactor's row and column statistics, a preconditioner): at rest a per-element state is a shard, like
  AdamW's, and every other state is whole and equal on every rank. Which state names are whole is recorded in
  the param group (``fullshard_whole_states``: a list per parameter, in ``params`` order), so it is saved
  with the optimizer's state dict and read back by ``engine/optim_state.py`` in every form; state dicts,
  checkpoints and resharding to another world size work as for AdamW.
- The first time a parameter's state appears (or whenever it holds non-tensor values) its owner sends the
  names, shapes and dtypes with one ``all_gather_object``; afterwards the layout is known on every rank.

[Note: exchange memory]
Parameters, gradients and state stay sharded between steps; during the step an owner holds its own parameters whole
(parameter, gradient, state: about ``3/N`` of the model's fp32 bytes when owners are balanced; pipelined, about four
of them at a time: [Note: pipelined whole steps] in ``whole_pipeline.py``), and nothing else of that size. The
gather runs one ``all_to_all`` per (piece, owner slot): in call ``(k, j)`` each owner receives piece ``k``
(parameter, gradient, each per-element state) of its ``j``-th parameter straight into that piece's whole tensor,
rank ``r``'s rows at their place (the dim-0 layout), so there is no received buffer nor concatenation on the owner.
The scatter runs one per (owner slot, piece): each owner sends its ``j``-th parameter's piece, then frees that
parameter's whole tensors, and every rank copies the bytes it received for slot ``j`` straight into its shards and
states. The calls are many but small (``3`` then ``2`` per owned matrix for Muon). Traffic per step: the parameter,
gradient and per-element state bytes gathered and the parameter and state bytes scattered, once each. Parameters
outside every unit are whole on every rank and stepped by every rank, as without this hook. Element-wise optimizers
(AdamW, SGD) never need it.

Tensor parallel parameters (a ``(dp, tp)`` mesh): the owner is a shard rank of the dp group, the same for every
tp rank (owners are planned on global shapes). After the gather over dp, the owners of one dp position (one per
tp rank) make each piece whole with a gather over tp, and all of them step the same whole matrix (the same
kernels on the same bytes: bitwise equal results), each keeping its own tp part for the scatter over dp. The
step's compute is therefore repeated on every tp rank (``tp`` times the work of a 1-D mesh of ``dp`` ranks).

Limits: every rank must have a gradient for the same parameters (sharded gradients are, after any backward);
``step(closure)`` is refused; an optimizer whose state changes names or shapes
after the first step is refused by the owner (the others then wait in the collective until its timeout).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.algorithms.whole_muon import SplitMuonSteps
from fullshard.algorithms.whole_owners import Bucket, Entry, assign_owners, is_muon, newton_schulz_cost, plan_owners
from fullshard.algorithms.whole_pieces import (
    Kind,
    as_bytes,
    concat,
    copy_bytes,
    fits,
    may_change,
    nbytes,
    rows_like,
    rows_of,
    set_whole_names,
    whole_names_of,
    whole_spec,
)
from fullshard.algorithms.whole_pipeline import PipelinedSteps
from fullshard.engine import (
    WHOLE_STATES_KEY,
    add_step_check,
    keep_dtensor_step,
    local_tensor,
    model_params,
    owner_label,
)

__all__ = [
    "MATRIX_OPTIMIZERS",
    "WHOLE_STATES_KEY",
    "WholeParamStep",
    "is_matrix_optimizer",
    "plan_owners",
    "register_matrix_optimizer",
    "whole_param_step",
]

# Optimizers known to need each parameter whole; register_matrix_optimizer adds a user's own.
MATRIX_OPTIMIZERS: list[type[torch.optim.Optimizer]] = [
    cls for cls in (getattr(torch.optim, "Muon", None), getattr(torch.optim, "Adafactor", None)) if cls is not None
]
# The hook of an optimizer is an attribute of it: a table keyed by the optimizer would keep it alive (its value
# refers to the optimizer), an attribute makes a cycle the garbage collector frees with the optimizer.
_ATTR = "_fullshard_whole_param_step"


def register_matrix_optimizer(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """Declare that ``cls`` needs whole parameters (usable as a class decorator); the Accelerator then turns on
    :func:`whole_param_step` for it, and a sharded model refuses to step it without."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(
            f"register_matrix_optimizer(cls={cls!r}): expected a subclass of torch.optim.Optimizer. Pass the class "
            "itself, e.g. register_matrix_optimizer(MyShampoo)."
        )
    if cls not in MATRIX_OPTIMIZERS:
        MATRIX_OPTIMIZERS.append(cls)
    return cls


def is_matrix_optimizer(optimizer: object) -> bool:
    """Whether ``optimizer`` is of a class that needs whole parameters (known to fullshard or registered)."""
    return isinstance(optimizer, tuple(MATRIX_OPTIMIZERS))


class WholeParamStep(SplitMuonSteps, PipelinedSteps):
    """Steps ``optimizer``'s sharded parameters whole, one owning rank each; see [Note: whole-parameter steps].

    Built by :func:`whole_param_step`; ``owners`` maps each sharded parameter's name to its owner's shard rank;
    :meth:`remove` takes the hooks off.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._model = model
        self._groups: list[list[Any]] | None = None  # the param groups' lists, while swapped
        self._specs: dict[int, list[tuple[str, Kind]]] = {}  # id(param) -> its state's kinds, as every rank has them
        self._known: set[int] = set()  # parameters whose state's kinds the owner has sent
        self._build()
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]
        setattr(optimizer, _ATTR, self)
        keep_dtensor_step(optimizer)  # its hooks step DTensor parameters whole

    def _build(self) -> None:
        """Entries and owners for the optimizer's parameters as they are now (again after ``add_param_group``:
        owners may change at any step, since nothing lives on an owner between steps)."""
        optimizer = self.optimizer
        by_id = {id(p.param): p for p in model_params(self._model)}
        buckets: dict[int, Bucket] = {}
        self._position: dict[int, tuple[int, int]] = {}  # id(param) -> (its param group, its place there)
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                self._position[id(param)] = (g, i)
                info = by_id.get(id(param))
                if info is None:
                    raise ValueError(
                        f"whole_param_step(model, optimizer={type(optimizer).__name__}): the optimizer holds a "
                        f"parameter of shape {tuple(param.shape)} that is not a parameter of `model`. Pass the "
                        "sharded model the optimizer was built from, after creating the optimizer from its parameters."
                    )
                if info.sp is None:
                    continue  # outside every unit: whole on every rank, stepped by every rank
                shard = info.unit.shard_group
                bucket = buckets.setdefault(
                    id(shard.shard_pg), Bucket(shard.shard_pg, shard.shard_size, shard.shard_rank)
                )
                bucket.entries.append(Entry(param, info.fqn, info.sp))
        self._buckets = list(buckets.values())
        for bucket in self._buckets:
            assign_owners(bucket, newton_schulz_cost if is_muon(optimizer) else math.prod)
        self.owners = {e.fqn: e.owner for b in self._buckets for e in b.entries}
        self._param_ids = [id(p) for group in optimizer.param_groups for p in group["params"]]

    def remove(self) -> None:
        """Take the hooks off: the optimizer steps on its shards again."""
        for handle in self._handles:
            handle.remove()
        if getattr(self.optimizer, _ATTR, None) is self:
            delattr(self.optimizer, _ATTR)

    # --- before the step: gather to the owners --------------------------------------------------------

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:  # args[0] is the optimizer
            raise ValueError(
                f"{type(optimizer).__name__}.step(closure=...) with whole-parameter steps: a closure would "
                "recompute gradients after they were gathered. Call loss.backward() first, then step() without one."
            )
        self._restore_groups()  # a step that raised left its groups swapped
        if [id(p) for group in optimizer.param_groups for p in group["params"]] != self._param_ids:
            self._build()  # add_param_group
        stepping: set[int] = set()
        for bucket in self._buckets:
            bucket.pipelined = self._can_pipeline(bucket)
            if bucket.pipelined:
                self._pipeline(bucket)  # stepped here, scattered by the post-hook: none of it in the step
            else:
                stepping.update(self._gather(bucket))
        self._swap_groups(stepping)

    def _gather(self, bucket: Bucket) -> list[int]:
        bucket.stepping = [e for e in bucket.entries if e.param.grad is not None]
        for e in bucket.stepping:
            self._specs[id(e.param)] = self._rest_spec(e)
        dtypes = {id(e.param): self._piece_dtypes(e) for e in bucket.stepping}
        owned = [[e for e in bucket.stepping if e.owner == o] for o in range(bucket.world)]
        wholes = self._post_gather(bucket, owned, dtypes, 0, max(len(o) for o in owned), None)
        for j, e in enumerate(owned[bucket.rank]):
            self._own_whole(e, wholes[j])
        return [id(e.param) for e in bucket.stepping]

    def _post_gather(
        self,
        bucket: Bucket,
        owned: list[list[Entry]],
        dtypes: dict[int, list[torch.dtype]],
        first: int,
        last: int,
        works: list[list[Any]] | None,
    ) -> list[list[torch.Tensor]]:
        """The gathers of owner slots ``first..last-1``; per slot, the whole tensors this rank receives as their
        owner. Without ``works`` each is done at once and its whole tensor is in the parameter's dim order (of a
        tensor parallel parameter: made whole by a gather over tp); with it (a list per slot) they run in the
        background and the tensors, plain dim-0 rows, are filled once slot ``j``'s works are done."""
        # One all_to_all per piece (parameter, gradient, each per-element state) and slot: in call (k, j) every
        # owner receives piece k of its j-th parameter straight into that piece's whole tensor (rank r's rows at
        # rank r's place: the dim-0 layout), so nothing is received beside the whole tensors (see [Note: exchange
        # memory]).
        me = bucket.rank
        wholes: list[list[torch.Tensor]] = [[] for _ in range(last)]
        for k in range(max((len(d) for d in dtypes.values()), default=0)):
            for j in range(first, last):
                to = {o: es[j] for o, es in enumerate(owned) if j < len(es) and len(dtypes[id(es[j].param)]) > k}
                # rows in the layout's dim order (a Shard(d) parameter's dim d first: see [Note: Shard(d)])
                send = concat([as_bytes(e.sp.move(self._local_pieces(e)[k])) for _, e in sorted(to.items())])
                in_splits = [nbytes(to[o], me, dtypes[id(to[o].param)][k]) if o in to else 0
                             for o in range(bucket.world)]  # fmt: skip
                e = to.get(me)
                if e is None:
                    whole, out_splits = torch.empty(0, dtype=torch.uint8), [0] * bucket.world
                else:
                    whole = torch.empty(e.sp.layout.shape, dtype=dtypes[id(e.param)][k])  # the layout's dim order
                    out_splits = [nbytes(e, r, whole.dtype) for r in range(bucket.world)]
                _all_to_all_into(as_bytes(whole) if e is not None else whole, send, out_splits, in_splits,
                                 bucket, None if works is None else works[j])  # fmt: skip
                if e is not None:
                    # in the parameter's dim order, plain (a copy only for Shard(d), d > 0; the background path
                    # takes dim-0 rows only, see _can_pipeline)
                    done = e.sp.full_of_gathered(e.sp.unmove(whole).contiguous()) if works is None else whole
                    wholes[j].append(done)
        return wholes

    def _post_scatter(
        self, bucket: Bucket, slot: dict[int, Entry], state: dict[str, Any], background: bool = True
    ) -> tuple[Any, ...]:
        """Start slot ``slot``'s scatter (one all_to_all per piece: the parameter, then each state in spec order;
        in the background, or each done before the next piece's send buffer is built); frees the owner's whole
        tensors. ``state``: the owner's whole state of its parameter in the slot. :meth:`_finish_scatter` copies the
        pieces into place."""
        me, works, outs = bucket.rank, [], []
        pieces = {id(e.param): self._scatter_pieces(e) for e in slot.values()}
        for k in range(max(len(p) for p in pieces.values())):
            at = {o: e for o, e in slot.items() if len(pieces[id(e.param)]) > k}
            send, in_splits = torch.empty(0, dtype=torch.uint8), [0] * bucket.world
            mine = at.get(me)
            if mine is not None and mine.whole is not None:
                name, d, kind = pieces[id(mine.param)][k]
                src = mine.whole.detach() if name is None else state[name]
                if kind[0] == "whole":
                    send = concat([as_bytes(src)] * bucket.world)
                else:
                    send = concat([as_bytes(rows_of(mine, src, r)) for r in range(bucket.world)])
                del src
                in_splits = [nbytes(mine, r, d, kind) for r in range(bucket.world)]
            out_splits = [
                nbytes(at[o], me, pieces[id(at[o].param)][k][1], pieces[id(at[o].param)][k][2]) if o in at else 0
                for o in range(bucket.world)
            ]
            out = torch.empty(sum(out_splits), dtype=torch.uint8)
            _all_to_all_into(out, send, out_splits, in_splits, bucket, works if background else None)
            del send  # in the background, the work holds it until done
            outs.append((out, at, out_splits))
        own = slot.get(me)
        if own is not None:  # sent (the send buffers are copies): free the whole tensors
            own.whole = None
        return slot, works, outs

    def _finish_scatter(self, posted: tuple[Any, ...]) -> None:
        slot, works, outs = posted
        for work in works:
            work.wait()
        got: dict[int, list[torch.Tensor]] = {id(e.param): [] for e in slot.values()}
        for out, at, out_splits in outs:
            offset = 0
            for o in range(len(out_splits)):
                if o in at:
                    got[id(at[o].param)].append(out.narrow(0, offset, out_splits[o]))
                    offset += out_splits[o]
        for e in slot.values():
            self._take_pieces(e, got.pop(id(e.param)))

    def _rest_spec(self, e: Entry) -> list[tuple[str, Kind]]:
        """The kinds of ``e``'s state at rest, the same on every rank (the whole names are in its param group)."""
        state = self.optimizer.state.get(e.param, {})
        whole_names = set(whole_names_of(self.optimizer, self._position[id(e.param)]))
        spec: list[tuple[str, Kind]] = []
        for name in sorted(state):
            value = state[name]
            if not isinstance(value, torch.Tensor):
                spec.append((name, ("value", value)))
            elif value.dim() > 0 and name not in whole_names:
                spec.append((name, ("rows", value.dtype)))
            else:
                spec.append((name, ("whole", value.dtype, tuple(value.shape))))
        return spec

    def _piece_dtypes(self, e: Entry) -> list[torch.dtype]:
        grad = e.param.grad
        if grad is None:
            raise AssertionError(f"whole_param_step: {e.fqn!r} is stepping without a gradient")
        rows = [kind[1] for _, kind in self._specs[id(e.param)] if kind[0] == "rows"]
        return [e.param.dtype, grad.dtype, *rows]

    def _local_pieces(self, e: Entry) -> list[torch.Tensor]:
        state = self.optimizer.state.get(e.param, {})
        rows = [state[name] for name, kind in self._specs[id(e.param)] if kind[0] == "rows"]
        return [local_tensor(t).detach() for t in (e.param, e.param.grad, *rows)]

    def _own_whole(self, e: Entry, wholes: list[torch.Tensor]) -> None:
        """On the owner: a whole parameter with ``wholes`` (parameter, gradient, per-element states), its state."""
        whole = nn.Parameter(wholes[0], requires_grad=e.param.requires_grad)
        whole.grad = wholes[1]
        rows = iter(wholes[2:])
        state = self.optimizer.state.pop(e.param, {})
        new: dict[str, Any] = {}
        for name, kind in self._specs[id(e.param)]:
            new[name] = next(rows) if kind[0] == "rows" else state[name]
        if new:
            self.optimizer.state[whole] = new
        e.whole = whole

    def _swap_groups(self, stepping: set[int]) -> None:
        entries = {id(e.param): e for b in self._buckets for e in b.entries}
        self._groups = [group["params"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            params = []
            for p in group["params"]:
                e = entries.get(id(p))
                if e is None:
                    params.append(p)
                elif id(p) in stepping and e.whole is not None:
                    params.append(e.whole)
            group["params"] = params

    def _restore_groups(self) -> None:
        if self._groups is None:
            return
        for group, params in zip(self.optimizer.param_groups, self._groups, strict=True):
            group["params"] = params
        self._groups = None
        for bucket in self._buckets:  # the owner keeps its rows of what it had gathered
            for e in bucket.entries:
                if e.whole is not None:
                    state = self.optimizer.state.pop(e.whole, {})
                    spec = dict(self._specs.get(id(e.param), []))
                    for name, kind in spec.items():
                        if kind[0] == "rows" and name in state:
                            state[name] = rows_like(e.param, rows_of(e, state[name]).clone())
                    if state:
                        self.optimizer.state[e.param] = state
                    e.whole = None
            bucket.stepping, bucket.scatters = [], []

    # --- after the step: scatter from the owners ------------------------------------------------------

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._groups is None:
            return
        stepped = [e for b in self._buckets for e in b.entries if e.whole is not None]
        states = {id(e.param): optimizer.state.pop(e.whole, {}) for e in stepped}
        del stepped
        for group, params in zip(optimizer.param_groups, self._groups, strict=True):
            group["params"] = params
        self._groups = None
        for bucket in self._buckets:
            if bucket.pipelined:
                while bucket.scatters:
                    self._finish_scatter(bucket.scatters.pop(0))
                bucket.stepping = []
            else:
                self._scatter(bucket, states)
        for bucket in self._buckets:
            for e in bucket.entries:
                e.whole = None

    def _scatter(self, bucket: Bucket, states: dict[int, dict[str, Any]]) -> None:
        entries = bucket.stepping
        self._exchange_specs(bucket, entries, states)
        owned = [[e for e in entries if e.owner == o] for o in range(bucket.world)]
        # One all_to_all per owner slot and piece (parameter, then each state in spec order): in call (j, k) every
        # owner sends every rank its rows of piece k of its j-th parameter (a whole state: all of it); once a slot
        # is sent its whole tensors are freed and its pieces copied into place (see [Note: exchange memory]).
        for j in range(max((len(es) for es in owned), default=0)):
            slot = {o: es[j] for o, es in enumerate(owned) if j < len(es)}
            own = slot.get(bucket.rank)
            state = states.get(id(own.param), {}) if own is not None else {}
            posted = self._post_scatter(bucket, slot, state, background=False)
            del state
            if own is not None:  # sent: its whole state goes with its whole tensors
                states.pop(id(own.param), None)
            self._finish_scatter(posted)
        bucket.stepping = []

    def _exchange_specs(self, bucket: Bucket, entries: list[Entry], states: dict[int, dict[str, Any]]) -> None:
        """Owners tell every rank the kinds of new state (first step, or non-tensor values)."""
        changing = [e for e in entries if id(e.param) not in self._known or may_change(self._specs[id(e.param)])]
        if not changing:
            for e in entries:
                if e.owner == bucket.rank and whole_spec(e, states[id(e.param)]) != self._specs[id(e.param)]:
                    raise RuntimeError(
                        f"[rank {dist.get_rank() if dist.is_initialized() else 0}] whole_param_step: the optimizer "
                        f"changed the state names of {e.fqn!r} after its first step; whole-parameter steps need a "
                        "state that keeps its names and shapes once created. Create every state at the first step."
                    )
            return
        mine = {e.fqn: whole_spec(e, states[id(e.param)]) for e in changing if e.owner == bucket.rank}
        if bucket.world > 1:
            gathered: list[Any] = [None] * bucket.world
            dist.all_gather_object(gathered, mine, group=bucket.pg)
        else:
            gathered = [mine]
        merged = {fqn: spec for part in gathered for fqn, spec in part.items()}
        for e in changing:
            self._known.add(id(e.param))
            self._specs[id(e.param)] = merged[e.fqn]
            set_whole_names(self.optimizer, self._position[id(e.param)], merged[e.fqn])

    def _scatter_pieces(self, e: Entry) -> list[tuple[str | None, torch.dtype, Kind]]:
        """What the owner sends back of ``e``, in order: (state name, or None for the parameter; dtype; kind)."""
        spec = self._specs[id(e.param)]
        pieces: list[tuple[str | None, torch.dtype, Kind]] = [(None, e.param.dtype, ("rows", e.param.dtype))]
        pieces += [(name, kind[1], kind) for name, kind in spec if kind[0] in ("rows", "whole")]
        return pieces

    def _take_pieces(self, e: Entry, pieces: list[torch.Tensor]) -> None:
        """This rank's rows of the stepped parameter and its state, from the owner (``pieces``: their bytes)."""
        local = local_tensor(e.param)
        with torch.no_grad():
            copy_bytes(local, pieces[0])
        old = self.optimizer.state.get(e.param, {})
        state: dict[str, Any] = {}
        it = iter(pieces[1:])
        for name, kind in self._specs[id(e.param)]:
            if kind[0] == "value":
                state[name] = kind[1]
            elif kind[0] == "whole":
                state[name] = next(it).clone().view(kind[1]).view(kind[2])
            else:
                rows, previous = next(it), old.get(name)
                if fits(previous, local.shape, kind[1]):
                    copy_bytes(local_tensor(previous), rows)
                    state[name] = previous
                else:
                    new = torch.empty_like(local, dtype=kind[1])  # the shard's strides (Shard(d): a movedim view)
                    copy_bytes(new, rows)
                    state[name] = rows_like(e.param, new)
        if state:
            self.optimizer.state[e.param] = state


def whole_param_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> WholeParamStep:
    """Step ``optimizer``'s sharded parameters whole; see [Note: whole-parameter steps].

    Call once, after creating the optimizer from the sharded ``model``'s parameters (``fully_shard`` or
    ``FullyShardedDataParallel``, any ``use_orig_params``). Collective at each step (every rank of the model's
    shard groups steps). Returns the handle (``remove()``; ``owners``); calling it again returns the same one.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"whole_param_step(optimizer={type(optimizer).__name__}): expected a torch.optim.Optimizer (pass the "
            "optimizer itself, e.g. accelerated_optimizer.optimizer)."
        )
    installed = getattr(optimizer, _ATTR, None)
    return installed if installed is not None else WholeParamStep(model, optimizer)


def _all_to_all_into(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    bucket: Bucket,
    works: list[Any] | None = None,
) -> None:
    """``all_to_all_single`` of bytes into ``out`` (a view of the tensors it fills); started in the background
    where ``works`` is given (its work is appended there: wait on it before reading ``out``)."""
    if bucket.world == 1:
        out.copy_(inp)
    elif works is None:
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=bucket.pg)
    else:
        works.append(dist.all_to_all_single(out, inp, out_splits, in_splits, group=bucket.pg, async_op=True))


def _refuse_on_shards(optimizer: torch.optim.Optimizer) -> None:
    """A known matrix optimizer over sharded parameters, without whole-parameter steps: refuse (every rank)."""
    if getattr(optimizer, _ATTR, None) is not None or not is_matrix_optimizer(optimizer):
        return
    sharded = [p for g in optimizer.param_groups for p in g["params"] if owner_label(p) is not None]
    if sharded:
        name = type(optimizer).__name__
        raise RuntimeError(
            f"{name}.step() over {len(sharded)} sharded parameters: {name} computes on each parameter whole, so on "
            "a rank's shard it would give another update than the unsharded run (or fail). Turn on whole-parameter "
            f"steps after creating it: fullshard.whole_param_step(model, optimizer); with the Accelerator, "
            "accelerator.prepare(model, optimizer) does it (plugin whole_param_step, on by default)."
        )


add_step_check(_refuse_on_shards)

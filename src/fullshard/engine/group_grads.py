"""GroupGrads: a unit's gradients, from the leaf autograd fills to the sharded ``.grad`` the optimizer reads.

``ParamGroup`` (``group.py``) mixes in :class:`GroupGrads`; this module owns everything about its gradients:
which parameters get one and where their shards lie in a reduced gradient (``_plan_grads``, [Note: frozen
parameters]), the autograd leaf the gathered views' gradients reach (``grad_full``) and the post-backward hook on
it, the unsharded gradient kept while sync is off (``hold_unsynced_grad``, ``expose_unsharded_grads``), and the
reduction, started (``reduce_grads``) and landed in the sharded parameters' ``.grad`` (``finish_reduce``).

Invariants: only trainable parameters (``grad_params``, in layout order) are reduced and get a sharded gradient;
``grad_full`` is ``flat_full`` or its prefix up to the last trainable block, and carries the one post-backward
hook, which holds the group weakly (:func:`_grads_ready_hook`); every reduction started is waited for before its
result lands or is dropped (``_pending``), so every rank issues the same collectives whatever its gradients. The
class reads, and does not set up, the group's buffers and layout (``flat_full``, ``packed``, ``direct``,
``layout_order``, ``world``, ``shard_numel``, ``precision``, ``shard_group``, ``comm_options``), which
``ParamGroup.__init__`` builds; it sets ``_plan_grads``'s fields and reads the per-backward state (``_pending``,
``_stashed_grads``, ``_unsynced_grad``, ``_partial_reduce``, ``_hooked``) that ``__init__`` initialises.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from fullshard.engine import collective_check, trace
from fullshard.engine.collectives import finish_reduce, foreach_reduce, full_block
from fullshard.engine.full_views import FullViewsPlan
from fullshard.engine.layout import group_offsets
from fullshard.engine.param import accumulate_sharded_grad
from fullshard.engine.precision import cast_to, widened_sum

__all__ = ["GroupGrads"]


class GroupGrads:
    """A ``ParamGroup``'s gradients; see the module docstring."""

    # --- which parameters get gradients, and the leaf that collects them --------------------------------

    def _plan_grads(self) -> None:
        """Which parameters get gradients (``sp.requires_grad``) and where their shards lie in a reduced gradient.

        Gradients are reduced and stored for trainable parameters only: frozen ones cost no gradient memory.
        """
        self.packed_grad_params = [sp for sp in self.packed if sp.requires_grad]
        self.direct_grad_params = [sp for sp in self.direct if sp.requires_grad]
        self.grad_params = self.packed_grad_params + self.direct_grad_params  # in layout order
        for sp, offset in zip(
            self.grad_params, group_offsets([sp.layout.padded_shard_numel for sp in self.grad_params])
        ):
            sp.grad_offset = offset
        self.requires_grad = bool(self.grad_params)
        # [Note: frozen parameters] flat_full's gradient covers its prefix up to the last trainable parameter's
        # block (the layout puts trainable parameters first), not the frozen ones after it: they cost no unsharded
        # gradient, no zeros in FullViews' backward, no reduce-scatter and no sharded gradient or optimizer state.
        ends = [self.world * (sp.offset + sp.layout.padded_shard_numel) for sp in self.grad_params]
        self.grad_end = max(ends) if ends else self.world * self.shard_numel
        in_prefix = [sp for sp in self.layout_order if self.world * sp.offset < self.grad_end]
        self._full_views = FullViewsPlan(in_prefix, self.world)  # see _register_full_views
        self._frozen_views = FullViewsPlan(self.layout_order[len(in_prefix) :], self.world).views

    def follow_requires_grad(self) -> None:
        """Take ``requires_grad_()`` calls on the sharded parameters since sharding (freezing or unfreezing after
        ``fully_shard``, as fine-tuning does): from the next gather on, a frozen parameter's view is detached and
        it gets no gradient, and a unit with no trainable parameter left reduces nothing (as torch's FSDP2)."""
        changed = False
        for sp in self.params:
            wanted = sp.sharded_param.requires_grad  # type: ignore[union-attr]
            if sp.requires_grad != wanted:
                sp.requires_grad, changed = wanted, True
        if not changed:
            return
        wrong = [sp for sp in self.params if sp.requires_grad and sp.dtype != self.dtype]
        if wrong:  # a unit of mixed dtypes lands gradients in one dtype (see [Note: mixed dtypes])
            raise ValueError(
                f"unit {self.label!r}: {[sp.fqn for sp in wrong]} became trainable after sharding, but they are "
                f"{wrong[0].dtype} in a unit whose gradients are {self.dtype} (it holds parameters of several "
                f"dtypes). Cast them to {self.dtype} before sharding, or wrap them in a unit of their own."
            )
        self._plan_grads()
        self._track_grads(self.flat_full)

    def _track_grads(self, full: torch.Tensor) -> None:
        """``full`` (``flat_full``) requires grad iff a parameter does and it is all the gradient's leaf; it then
        carries the post-backward hook. Otherwise the leaf is its prefix (see [Note: frozen parameters]), made at the
        next gather (a view needs the storage): see :meth:`_leaf_for_grads`."""
        self._grad_leaf = None
        whole = self.grad_end == full.numel()
        full.requires_grad_(self.requires_grad and whole)
        if full.requires_grad:
            self._hook(full)

    def _hook(self, leaf: torch.Tensor) -> None:
        if not any(t is leaf for t in self._hooked):  # the unit's post-backward (see observe)
            leaf.register_post_accumulate_grad_hook(_grads_ready_hook(weakref.ref(self)))
            self._hooked.append(leaf)  # views of flat_full's storage: kept, they cost no memory

    @property
    def grad_full(self) -> torch.Tensor:
        """The autograd leaf the gathered parameters' gradients reach: ``flat_full``, or its prefix up to the last
        trainable parameter (see [Note: frozen parameters]); its ``.grad`` is the unsharded gradient."""
        return self.flat_full if self._grad_leaf is None else self._grad_leaf

    def _leaf_for_grads(self) -> torch.Tensor:
        """``grad_full``, made once per ``flat_full`` (allocated: a view of a freed storage fails its bounds check)
        when it is a prefix; it shares ``flat_full``'s storage object and version counter."""
        if self.requires_grad and self._grad_leaf is None and self.grad_end != self.flat_full.numel():
            with torch.no_grad():
                leaf = self.flat_full.detach().narrow(0, 0, self.grad_end)
            self._grad_leaf = leaf.requires_grad_(True)
            self._hook(leaf)
        return self.grad_full

    # --- gradients --------------------------------------------------------------------------------------

    def take_unsharded_grad(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This backward's gradient of ``flat_full`` in ``dtype`` (default: the reduce dtype; zeros if nothing reached
        it); detaches it from ``flat_full`` so that the next backward starts from none."""
        leaf = self.grad_full
        grad = leaf.grad
        leaf.grad = None
        self._full_views.take_received()
        rdtype = self.precision.reduce_dtype if dtype is None else dtype
        held, self._unsynced_grad = self._unsynced_grad, None
        if held is not None:
            grad = held if grad is None else held.add_(grad)
        if grad is None:
            return torch.zeros(leaf.numel(), dtype=rdtype, device=self.device)
        return grad if grad.dtype == rdtype else grad.to(rdtype)

    def hold_unsynced_grad(self) -> None:
        """With gradient sync off, move this backward's unsharded gradient into a sum kept in ``reduce_dtype`` when
        that is wider than the gradient (float32 under bf16 compute), as torch's FSDP2 does: micro-batches then add
        up in float32 instead of in bf16 (autograd's own accumulation into ``grad_full.grad``). The next reduction
        (:meth:`take_unsharded_grad`) adds its backward's gradient to the sum and reduces it. Unlike torch, a
        narrower ``reduce_dtype`` keeps the sum in the gradient's dtype (torch sums in the narrower one): the result
        is rounded to it once, at the reduction.
        """
        leaf = self.grad_full
        held = widened_sum(self._unsynced_grad, leaf.grad, self.precision.reduce_dtype)
        if held is not None:
            leaf.grad, self._unsynced_grad = None, held

    def reduce_grads(self) -> None:
        """Start reducing ``flat_full.grad`` (or zeros, if it has none) to this rank's shard.

        Only trainable parameters are reduced (see :func:`collectives.foreach_reduce`). The unsharded gradient
        is freed here; :meth:`finish_reduce` lands the result in the sharded parameters' ``.grad``.
        """
        with trace.phase(trace.REDUCE_SCATTER):
            if not self.requires_grad:  # counted all the same: every rank passes here (see issue)
                collective_check.issue("reduce_scatter", self.label, self.shard_group.reduce_pg, lambda tag: [])
                return
            self._restore_sharded_grads()
            received = self._full_views.take_received()
            grad = self.take_unsharded_grad()
            packed, direct = self.packed_grad_params, self.direct_grad_params
            pending = foreach_reduce(
                grad, packed, direct, self.shard_group, self.label, self._comm_hook, self.comm_options
            )
            self._pending.append((pending, received))

    def drop_reductions(self) -> None:
        """Wait for started reductions and discard them, with the unreduced gradient (``reset_iter_state``)."""
        for pending, _ in self._pending:
            for work in pending.works:
                work.wait()
        self._pending.clear()
        self._partial_reduce = None
        self._unsynced_grad = None
        if self.grad_full.grad is not None:
            self.grad_full.grad = None

    def expose_unsharded_grads(self) -> None:
        """Show each trainable parameter's unreduced local gradient, in its full shape, as its ``.grad``.

        Used while gradient sync is off (``no_sync()``), as torch's FSDP1 exposes them: the views alias
        ``flat_full.grad``, where autograd keeps accumulating. Sharded gradients already there are set
        aside, and :meth:`reduce_grads` puts them back before adding the reduced accumulation.
        """
        grad = self.grad_full.grad
        if grad is None:
            return
        if self._stashed_grads is None:
            self._stashed_grads = [sp.sharded_param.grad for sp in self.grad_params]
        for sp in self.grad_params:
            view = sp.unmove(full_block(grad, sp, self.world).narrow(0, 0, sp.layout.numel).view(sp.layout.shape))
            param = sp.sharded_param
            if (view.shape, view.dtype, view.device) == (param.shape, param.dtype, param.device):
                param.grad = view
            else:
                # Assigning .grad checks it against the (sharded) parameter, but the .data of the gradient once
                # assigned may be anything; torch's FSDP1 exposes unsharded gradients the same way.
                param.grad = torch.empty_like(param)
                param.grad.data = view

    def forget_cleared_unsharded_grads(self) -> None:
        """After ``zero_grad()`` cleared every exposed gradient, drop the accumulation behind them too."""
        if self._stashed_grads is None or any(sp.sharded_param.grad is not None for sp in self.grad_params):
            return
        self._stashed_grads = None
        self.grad_full.grad = None

    def _restore_sharded_grads(self) -> None:
        if self._stashed_grads is None:
            return
        for sp, grad in zip(self.grad_params, self._stashed_grads):
            sp.sharded_param.grad = grad
        self._stashed_grads = None

    def finish_reduce(self) -> None:
        """Wait for started reductions and accumulate them into the sharded parameters' ``.grad``."""
        while self._pending:
            pending, received = self._pending.pop(0)
            partial, self._partial_reduce = self._partial_reduce, None
            output = finish_reduce(pending, self.shard_group, self.label, self.comm_options, partial)
            if output is None:  # requires_all_reduce off: keep the sum for a later backward
                self._partial_reduce = pending.output
                continue
            output = cast_to(output, self.storage_device, self.precision.grad_dtype, non_blocking=False)
            self._accumulate_sharded_grads(output, None if all(received) else self._unused(received))

    def accumulate_sharded_grads(self, flat_grad: torch.Tensor) -> None:
        """Add a reduced ``flat_grad`` (1D, G_t, the trainable parameters' shards, storage device and gradient dtype)
        into their ``.grad`` (world-size-invariant mode reduces on its own, see ``invariant.py``)."""
        self._accumulate_sharded_grads(flat_grad)

    def _unused(self, received: list[bool]) -> set[int]:
        """``id`` of each trainable parameter that got no gradient on this rank (``received``: layout order)."""
        return {id(sp) for sp, got in zip(self.layout_order, received) if not got and sp.requires_grad}

    def _accumulate_sharded_grads(self, flat_grad: torch.Tensor, unused: set[int] | None = None) -> None:
        """Add ``flat_grad`` (1D, G_t, the trainable parameters' shards) into their ``.grad``.

        Runs for every parameter at every step, so each gradient costs one view op (``as_strided`` straight to its
        shape, as torch FSDP2 cuts its sharded gradients) and, under ``fully_shard``, a ``DTensor`` sharing the
        sharded parameter's spec (see :meth:`ShardGroup.dtensor_like`).

        ``unused``: parameters no output used on this rank (by ``id``): one without a ``.grad`` keeps none unless
        its reduced shard is not zero, and each parameter's post-accumulate-grad hooks run (see
        :func:`param.accumulate_sharded_grad`).
        """
        flat_grad = flat_grad.contiguous()
        base = flat_grad.storage_offset()
        dtensor_of = self.shard_group if self.use_dtensor else None
        for sp in self.grad_params:
            lay = sp.layout
            local = sp.unmove(flat_grad.as_strided(lay.local_shape, lay.local_stride, base + sp.grad_offset))
            accumulate_sharded_grad(sp.sharded_param, local, dtensor_of, unused is not None and id(sp) in unused)


def _grads_ready_hook(group_ref: weakref.ref[GroupGrads]) -> Callable[[torch.Tensor], None]:
    """``flat_full``'s post-accumulate-grad hook: the group's ``on_grads_ready``. It holds the group weakly: the
    hook lives in ``flat_full``'s C++ autograd state, which the views the module computes with keep alive from
    C++ (their grad_fn's AccumulateGrad), where the garbage collector cannot see it; a strong reference would make
    the group, its module and every parameter and optimizer state behind it immortal."""

    def hook(_: torch.Tensor) -> None:
        group = group_ref()
        if group is not None and group._on_grads_ready is not None:
            group._on_grads_ready()

    return hook

"""One original parameter under sharding: where it is registered, its layout and its sharded form.

A :class:`ShardedParam` never owns storage. Its sharded parameter is a view into its group's flat shard
(see ``group.py``), and what modules see during compute is a view into the group's flat unsharded buffer.
The original ``nn.Parameter`` is *retired* when sharding starts: its storage is freed and it is recorded,
so that an optimizer built over it before wrapping is detected at its first ``step()`` with a message
instead of silently stepping on nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.engine.layout import ShardLayout
from fullshard.engine.mesh import ShardGroup, TPSpec

__all__ = [
    "ShardedParam",
    "accumulate_sharded_grad",
    "add_step_check",
    "local_tensor",
    "owner_label",
    "replacement_for",
    "retire",
    "retired_data_ptr",
    "set_owner",
]


@dataclass
class ShardedParam:
    """An original parameter of a unit.

    - ``fqn``: its name relative to the unit's module (the first name, for tied parameters).
    - ``registrations``: every ``(module, attribute)`` it is registered under (several when tied).
    - ``layout``: its dim-0 split over the shard group (see [Note: dim-0 layout] in ``layout.py``), of
      ``gathered_shape``: the parameter's shape, or its local shape for a tensor parallel one.
    - ``tp``: for a parameter that came as a tensor parallel ``DTensor``, how it lies (see
      [Note: tensor parallel parameters] in ``mesh.py``); ``None`` otherwise.
    - ``offset``: where its padded shard starts in the group's flat shard.
    - ``sharded_param``: the ``nn.Parameter`` the optimizer steps on, ``layout.local_shape``; a view of the
      group's flat shard (a ``DTensor`` over the unit's mesh under ``fully_shard``).
    """

    fqn: str
    registrations: list[tuple[nn.Module, str]]
    layout: ShardLayout
    dtype: torch.dtype
    requires_grad: bool
    offset: int = 0
    grad_offset: int = 0  # where its gradient shard starts among the group's trainable parameters
    sharded_param: nn.Parameter | None = None
    tp: TPSpec | None = None
    shard_dim: int = 0  # the dim split over the shard group: see [Note: Shard(d)]
    byte_offset: int = 0  # where its padded shard starts in a byte flat shard (a unit of mixed dtypes, group.py)

    # [Note: Shard(d)]
    # A parameter placed ``Shard(d)`` (``fully_shard(shard_placement_fn=...)``) is laid out as the same parameter
    # with dim ``d`` moved first (``movedim(d, 0)``): ``layout`` is of that *moved* shape, so its flat-buffer blocks,
    # padding and collectives are those of a dim-0 parameter. Everything a caller sees is in the parameter's own
    # dim order: ``local_view`` and the sharded parameter are ``movedim(0, d)`` views of the moved rows (not
    # contiguous), ``rows_of`` takes and gives parameter-ordered tensors, and modules compute with permuted views of
    # ``flat_full`` (see ``full_views.py``). With ``d == 0`` every move is the identity.

    def unmove(self, moved: torch.Tensor) -> torch.Tensor:
        """A tensor in the layout's (moved) dim order, viewed in the parameter's dim order."""
        return moved if self.shard_dim == 0 else moved.movedim(0, self.shard_dim)

    def move(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor in the parameter's dim order, viewed in the layout's (moved) dim order."""
        return tensor if self.shard_dim == 0 else tensor.movedim(self.shard_dim, 0)

    def unmove_shape(self, moved: tuple[int, ...]) -> tuple[int, ...]:
        d = self.shard_dim
        return moved if d == 0 else (*moved[1 : d + 1], moved[0], *moved[d + 1 :])

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's (global) shape, as its unsharded module had it."""
        return self.unmove_shape(self.layout.shape) if self.tp is None else self.tp.shape

    @property
    def gathered_shape(self) -> tuple[int, ...]:
        """What an all-gather over the shard group rebuilds: ``shape``, or this rank's tp part of it."""
        return self.unmove_shape(self.layout.shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """This rank's shard's shape, in the parameter's dim order (the sharded parameter's local tensor)."""
        return self.unmove_shape(self.layout.local_shape)

    def compute_view(self, gathered: torch.Tensor) -> torch.Tensor:
        """What modules compute with, from a ``gathered_shape`` tensor (a tp ``DTensor`` for a tp parameter)."""
        return gathered if self.tp is None else self.tp.compute_view(gathered)

    def full_of_gathered(self, gathered: torch.Tensor) -> torch.Tensor:
        """The full (global) tensor from a ``gathered_shape`` one (a collective over tp for a tp parameter)."""
        return gathered if self.tp is None else self.tp.full_of(gathered)

    def gathered_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's ``gathered_shape`` part of a full (global) tensor (no communication)."""
        return full if self.tp is None else self.tp.local_of(full)

    def register(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` what every registration of this parameter resolves to.

        Writes ``module._parameters`` directly: during compute the registered tensor is a non-leaf view,
        which ``nn.Module.__setattr__`` would refuse.
        """
        for module, name in self.registrations:
            module._parameters[name] = tensor  # type: ignore[assignment]

    def register_sharded(self) -> None:
        if self.sharded_param is None:
            raise AssertionError(f"{self.fqn}: sharded parameter not built yet")
        self.register(self.sharded_param)

    def local_view(self, flat_shard: torch.Tensor) -> torch.Tensor:
        """This rank's real rows inside a flat shard-sized buffer (a view; no copy): a buffer of elements laid out as
        the group's, or the bytes of a unit of mixed dtypes (see [Note: mixed dtypes] in ``group.py``)."""
        if flat_shard.dtype == torch.uint8 and self.dtype != torch.uint8:
            nbytes = self.layout.local_numel * self.dtype.itemsize
            rows = flat_shard.narrow(0, self.byte_offset, nbytes).view(self.dtype)
            return self.unmove(rows.view(self.layout.local_shape))
        return self.unmove(flat_shard.narrow(0, self.offset, self.layout.local_numel).view(self.layout.local_shape))

    def rows_of(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """The real rows of ``full`` (of ``gathered_shape``) that this rank (or shard rank ``rank``) holds,
        shaped like its local shard (a view where ``full`` allows one); see [Note: dim-0 layout]."""
        lay = self.layout if rank is None else self.layout.for_rank(rank)
        rows = self.move(full).reshape(lay.dim0, lay.row_numel).narrow(0, lay.row_offset, lay.local_rows)
        return self.unmove(rows.reshape(lay.local_shape))

    def full_of(self, by_rank: torch.Tensor, world: int) -> torch.Tensor:
        """The parameter's gathered tensor (``gathered_shape``, a view) from ``by_rank`` ``(world, G)``: every rank's
        flat shard of a buffer laid out like the group's flat shard, as an all-gather returns them."""
        lay = self.layout
        if by_rank.dtype == torch.uint8 and self.dtype != torch.uint8:  # bytes of a unit of mixed dtypes
            nbytes = lay.padded_shard_numel * self.dtype.itemsize
            block = by_rank.narrow(1, self.byte_offset, nbytes).contiguous().view(self.dtype)
        else:
            block = by_rank.narrow(1, self.offset, lay.padded_shard_numel)
        rows = block.reshape(world * lay.rows_per_rank, lay.row_numel).narrow(0, 0, lay.dim0)
        return self.unmove(rows.reshape(lay.shape))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a ``DTensor``'s local tensor (no autograd view), else ``tensor`` itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # type: ignore[attr-defined]


def accumulate_sharded_grad(
    param: torch.Tensor, local: torch.Tensor, dtensor_of: ShardGroup | None, unused: bool = False
) -> None:
    """Add ``local`` (this rank's reduced shard of ``param``'s gradient, in its layout) into the sharded
    ``param.grad``, or make it that ``.grad`` (a ``DTensor`` laid out as ``param`` under ``dtensor_of``, the unit's
    shard group, when ``fully_shard`` made ``param`` one; ``local`` itself when ``None``), then run ``param``'s
    post-accumulate-grad hooks, as torch's FSDP2 runs them: once per reduction, with the sharded ``.grad`` in place.

    ``unused``: no output used ``param`` on this rank. Without a ``.grad`` it then keeps none, as without sharding
    (an optimizer leaves it alone), unless ``local`` is not zero: another rank used it, and this rank's shard of the
    average is its gradient. The reduction is the same on every rank either way (ranks may disagree on ``unused``),
    so that no rank issues different collectives.
    """
    if param.grad is None:
        if unused and not bool(local.any()):
            return
        param.grad = local if dtensor_of is None else dtensor_of.dtensor_like(local, param)  # type: ignore[arg-type]
    else:
        local_tensor(param.grad).add_(local)
    hooks = param._post_accumulate_grad_hooks  # type: ignore[attr-defined]
    if hooks:
        for hook in tuple(hooks.values()):
            hook(param)


# Keyed by id(): tensors compare elementwise, so they cannot be dictionary keys by value. The weak
# reference confirms the id still names the same object; the finalizer drops entries with their tensor.
_REPLACEMENTS: dict[int, tuple[weakref.ref[torch.Tensor], nn.Parameter, int]] = {}
_GUARD_INSTALLED = False
# The owner of a sharded parameter is an attribute of the parameter, not a weak reference to it:
# nn.Module._apply (to_empty, .to) swaps DTensor parameters in place with torch.utils.swap_tensors, which
# refuses tensors that have weak references. The swap moves attributes away, so set_owner runs again after it.
_OWNER_ATTR = "_fullshard_owner"


def retire(original: nn.Parameter, replacement: nn.Parameter) -> None:
    """Free ``original``'s storage and remember that ``replacement`` now stands for it (and where its data was,
    which Accelerate's optimizer mappings use as its key: see :func:`retired_data_ptr`)."""
    key = id(original)
    _REPLACEMENTS[key] = (weakref.ref(original), replacement, original.data_ptr())
    weakref.finalize(original, _REPLACEMENTS.pop, key, None)
    freed = local_tensor(original)  # a tensor parallel DTensor frees its local tensor
    freed.data = torch.empty(0, dtype=freed.dtype, device=freed.device)
    _install_optimizer_guard()


def owner_label(param: torch.Tensor) -> str | None:
    """The unit whose sharded parameter ``param`` is, if it is one."""
    return getattr(param, _OWNER_ATTR, None)


def set_owner(param: nn.Parameter, label: str) -> None:
    setattr(param, _OWNER_ATTR, label)


def _retired_entry(original: torch.Tensor) -> tuple[Any, nn.Parameter | None, int | None]:
    entry = _REPLACEMENTS.get(id(original))
    return entry if entry is not None and entry[0]() is original else (None, None, None)


def replacement_for(original: torch.Tensor) -> nn.Parameter | None:
    """The sharded parameter that replaced ``original`` when its module was sharded, if any."""
    return _retired_entry(original)[1]


def retired_data_ptr(original: torch.Tensor) -> int | None:
    """``original.data_ptr()`` as it was before sharding freed it (``None`` if ``original`` was not retired)."""
    return _retired_entry(original)[2]


_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
# Checks other packages add (algorithms/whole_step.py: a matrix optimizer on shards without whole-parameter steps),
# run with the retired-parameter check: at an optimizer's first step, and again when its parameters change.
_STEP_CHECKS: list[Callable[[torch.optim.Optimizer], None]] = []


def add_step_check(check: Callable[[torch.optim.Optimizer], None]) -> None:
    """Run ``check(optimizer)`` before the first ``step()`` of every optimizer (once sharding has begun)."""
    if check not in _STEP_CHECKS:
        _STEP_CHECKS.append(check)


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Refuse to step an optimizer that holds parameters retired by sharding."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if _CHECKED.get(optimizer) == len(params):
        return
    retired = sum(1 for p in params if replacement_for(p) is not None)
    if retired:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): {retired} of its {len(params)} parameters are the original, "
            "unsharded parameters of a model that was sharded after the optimizer was created; they no longer "
            "hold data and would never be updated. Create the optimizer after wrapping, from the sharded "
            "model's parameters: model = FullyShardedDataParallel(model) (or fully_shard(model)), then "
            "optimizer = torch.optim.AdamW(model.parameters(), ...)."
        )
    for check in _STEP_CHECKS:
        check(optimizer)
    _CHECKED[optimizer] = len(params)


def _install_optimizer_guard() -> None:
    global _GUARD_INSTALLED
    if not _GUARD_INSTALLED:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_check_optimizer)
        _GUARD_INSTALLED = True

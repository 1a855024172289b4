"""Public enums and configuration objects of the sharding engine.

Names, members and fields follow torch's ``torch.distributed.fsdp`` so that code written for it runs
after changing its imports. Every enum argument the engine takes also accepts the member's name as a
string and torch's enum of the same name (see :func:`fullshard.engine.coerce.coerce_enum`).

[Note: equal to torch's]
A plugin or a config holds these objects, and code written for torch compares them with torch's
(``plugin.sharding_strategy == torch.distributed.fsdp.ShardingStrategy.FULL_SHARD``). So an enum member here equals
the member of the same name of a foreign enum of the same class name, and a config equals a foreign dataclass of
the same class name whose common fields are equal; both ways round, since torch's classes leave ``==`` with
another class to us. Nothing here imports torch's FSDP: the comparison is by names.

This module imports nothing from the rest of the engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "Offload",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]


class PlacementError(ValueError, AssertionError):
    """A ``shard_placement_fn`` result that cannot shard its parameter: a ``ValueError``, and an ``AssertionError``
    as torch's ``fully_shard`` raises for the same input (so ``except`` clauses written for either catch it)."""


class AppliedTwiceError(ValueError, AssertionError):
    """``fully_shard`` applied to a module that already is a unit: a ``ValueError``, and an ``AssertionError`` with
    torch's sentence, as torch's ``fully_shard`` raises (so ``except`` clauses and tests written for either match)."""


class _PeerEnum(enum.Enum):
    """An enum whose members equal same-named members of a same-named foreign enum; see [Note: equal to torch's]."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, enum.Enum) and type(other) is not type(self):
            return type(other).__name__ == type(self).__name__ and other.name == self.name
        return self is other

    def __hash__(self) -> int:
        return hash(self.name)


def _peer_equal(cls: type) -> type:
    """Let dataclass ``cls`` equal a foreign dataclass of the same class name with equal common fields (the same
    class compares all fields, as before); see [Note: equal to torch's]."""
    own_eq = cls.__eq__

    def __eq__(self: Any, other: object) -> Any:  # noqa: N807
        if type(other) is type(self) or not is_dataclass(other) or type(other).__name__ != cls.__name__:
            return own_eq(self, other)
        common = {f.name for f in fields(self)} & {f.name for f in fields(other)}
        return all(getattr(self, name) == getattr(other, name) for name in common)

    cls.__eq__ = __eq__  # type: ignore[method-assign]
    return cls


class ShardingStrategy(_PeerEnum):
    """How parameters, gradients and optimizer states are split across data-parallel ranks.

    - ``FULL_SHARD``: parameters, gradients and optimizer states are sharded; parameters are gathered
      before each unit's forward and backward and freed after each (ZeRO-3).
    - ``SHARD_GRAD_OP``: as FULL_SHARD, but parameters stay gathered from forward until the end of
      backward (ZeRO-2 style memory for parameters, one all-gather per step).
    - ``NO_SHARD``: every rank holds everything; gradients are all-reduced (like DDP).
    - ``HYBRID_SHARD``: FULL_SHARD inside a shard group (e.g. a node), replicated across groups.
    - ``_HYBRID_SHARD_ZERO2``: SHARD_GRAD_OP inside a shard group, replicated across groups.
    """

    FULL_SHARD = 1
    SHARD_GRAD_OP = 2
    NO_SHARD = 3
    HYBRID_SHARD = 4
    _HYBRID_SHARD_ZERO2 = 5


class BackwardPrefetch(_PeerEnum):
    """When the next unit's all-gather is issued during backward.

    - ``BACKWARD_PRE``: before the current unit computes its gradients (most overlap, one more unit of
      parameters alive).
    - ``BACKWARD_POST``: after the current unit computes its gradients.
    """

    BACKWARD_PRE = 1
    BACKWARD_POST = 2


class StateDictType(_PeerEnum):
    """Which kind of state dict ``state_dict()`` returns on a sharded module."""

    FULL_STATE_DICT = 1
    LOCAL_STATE_DICT = 2
    SHARDED_STATE_DICT = 3


class OptimStateKeyType(_PeerEnum):
    """How the keys of an optimizer state dict's ``state`` are given: parameter names or ids."""

    PARAM_NAME = 1
    PARAM_ID = 2


def _default_mp_ignored_classes() -> tuple[type[nn.Module], ...]:
    return (nn.modules.batchnorm._BatchNorm,)


@_peer_equal
@dataclass(frozen=True)
class MixedPrecision:
    """Mixed precision for :class:`FullyShardedDataParallel`.

    - ``param_dtype``: dtype of the gathered parameters that forward and backward compute with. The
      sharded parameters the optimizer steps on keep their original dtype.
    - ``reduce_dtype``: dtype gradients are reduced in; defaults to ``param_dtype``.
    - ``buffer_dtype``: dtype buffers are cast to; defaults to ``param_dtype``.
    - ``keep_low_precision_grads``: leave the sharded gradients in ``reduce_dtype`` instead of casting
      them back to the parameter dtype.
    - ``cast_forward_inputs`` / ``cast_root_forward_inputs``: cast floating-point forward inputs to
      ``param_dtype`` for every unit / for the root unit.
    - ``_module_classes_to_ignore``: module classes that an auto-wrap policy wraps on their own and runs
      in full precision (batch norm by default).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: tuple[type[nn.Module], ...] = field(default_factory=_default_mp_ignored_classes)


@_peer_equal
@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Mixed precision for :func:`fully_shard`.

    - ``param_dtype``: dtype of the gathered (unsharded) parameters used in forward and backward.
    - ``reduce_dtype``: dtype gradients are reduced in; defaults to ``param_dtype``.
    - ``output_dtype``: dtype floating-point forward outputs are cast to; ``None`` leaves them.
    - ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@_peer_equal
@dataclass(frozen=True)
class CPUOffload:
    """``offload_params=True`` keeps sharded parameters and their gradients on the CPU; the optimizer
    steps there and parameters are copied to the compute device for forward and backward."""

    offload_params: bool = False


@_peer_equal
@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: the base of the offload policies of :func:`fully_shard`."""


@_peer_equal
@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Offload sharded parameters and gradients to the CPU; ``pin_memory`` pins them for faster,
    asynchronous copies to and from an accelerator."""

    pin_memory: bool = True


@dataclass(frozen=True)
class Offload:
    """What both entry points resolve their offload argument to (``CPUOffload(offload_params=True)`` or a
    ``CPUOffloadPolicy``): keep the shards and their gradients on the CPU (``pin_memory``: pinned, when an
    accelerator exists)."""

    pin_memory: bool = True


@dataclass(frozen=True)
class StateDictConfig:
    """Base of the model state dict configs: ``offload_to_cpu`` moves the values to the CPU."""

    offload_to_cpu: bool = False


@dataclass(frozen=True)
class FullStateDictConfig(StateDictConfig):
    """``rank0_only``: only rank 0 receives the full state dict; other ranks get an empty dict."""

    rank0_only: bool = False


@dataclass(frozen=True)
class LocalStateDictConfig(StateDictConfig):
    """Each rank's own shards, as plain tensors."""


@dataclass(frozen=True)
class ShardedStateDictConfig(StateDictConfig):
    """Each rank's own shards as distributed tensors that torch.distributed.checkpoint can reshard."""

    _use_dtensor: bool = False


@dataclass(frozen=True)
class OptimStateDictConfig:
    """Base of the optimizer state dict configs: ``offload_to_cpu`` moves the values to the CPU."""

    offload_to_cpu: bool = True


@dataclass(frozen=True)
class FullOptimStateDictConfig(OptimStateDictConfig):
    """``rank0_only``: only rank 0 receives the full optimizer state dict."""

    rank0_only: bool = False


@dataclass(frozen=True)
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Each rank's own optimizer state shards, as plain tensors."""

    offload_to_cpu: bool = False


@dataclass(frozen=True)
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Each rank's own optimizer state shards as distributed tensors."""

    _use_dtensor: bool = False


@dataclass(frozen=True)
class StateDictSettings:
    """The state dict type and configs in force on a module."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig

"""Model state dicts of sharded modules: FULL, SHARDED and LOCAL, through hooks on every unit.

This module holds the hooks, the state dict type settings and the checked load; what a module's state dict holds
and how a given one differs (``expected_entries``, ``mismatches``, the registrations of unit parameters) come from
``state_dict_entries.py``.

[Note: state dict hooks]
Every unit module (a ``FullyShardedDataParallel`` wrapper or a ``fully_shard`` module) carries three hooks,
so that ``state_dict()`` / ``load_state_dict()`` work from any module above it (the unit itself, a plain
module holding units, ``DDP(FSDP(...))``):

- state-dict post-hook: ``nn.Module.state_dict`` has stored the unit's registered (sharded) parameters
  under their raw keys; the hook replaces them by what the unit's :class:`StateDictType` asks for, then a
  wrapper drops its ``_fsdp_wrapped_module.`` segment from every key below it, keeping the order. Keys are
  therefore the original module's keys, and a FULL state dict equals the unwrapped model's.
- load pre-hook: a wrapper inserts its segment back into the incoming keys below it; then the unit takes its
  own parameters' entries out of the dict and copies this rank's rows of them into its flat shard, so
  ``nn.Module`` never copies a full tensor into a shard.
- load post-hook: the keys the unit took are removed from ``missing_keys`` (``nn.Module`` reports them,
  not finding them any more), and every reported key is cleaned of wrapper segments.

Values, per type (``G`` = the unit's padded shard numel, see [Note: group buffers] in ``group.py``):

- FULL_STATE_DICT: full tensors, gathered one unit at a time; with ``rank0_only`` ranks other than 0 drop
  each unit's tensors (and buffers) as soon as they are gathered, ending with ``{}``.
- SHARDED_STATE_DICT: per parameter, a ``DTensor`` of the full shape over the unit's mesh: ``Shard(0)`` on a
  1-D mesh, ``(Replicate(), Shard(0))`` on a 2-D (replicate, shard) mesh, ``Replicate()`` for NO_SHARD; a
  tensor parallel parameter's lies on the dp and tp mesh (see [Note: tensor parallel parameters] in ``mesh.py``).
  Its local tensor is a view of the flat shard (no copy), as ``fully_shard``'s parameters are.
- LOCAL_STATE_DICT: per unit, ``<unit prefix>_flat_param``: a 1-D ``DTensor`` (global ``shard_size * G``
  elements, same placements) whose local tensor is this rank's padded flat shard. It only loads into the
  same model on the same number of ranks.

Buffers are saved in the dtype they had when the unit was built, even after mixed precision cast them
(torch's FSDP does the same), so that the state dict of a bf16-trained model loads into an fp32 one.

Loading takes full tensors or DTensors (any mesh and placement of the right global shape) for the
parameter keys, or ``_flat_param`` entries, whatever the type in force. Buffers and parameters outside any
unit are left to ``nn.Module``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from fullshard.engine.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fullshard.engine.coerce import coerce_enum
from fullshard.engine.extension import ExtensionParam, ExtensionParams
from fullshard.engine.group import ParamGroup, ShardState
from fullshard.engine.names import clean_key
from fullshard.engine.param import ShardedParam
from fullshard.engine.state_dict_entries import (
    FLAT_PARAM,
    expected_entries,
    extension_params,
    mismatches,
    sharded_registrations,
)
from fullshard.engine.unit_state import TrainingState, UnitState
from fullshard.ranks import global_rank

__all__ = [
    "FLAT_PARAM",
    "expected_entries",
    "extension_params",
    "get_state_dict_type",
    "install_state_dict_hooks",
    "load_checked",
    "mismatches",
    "rows_of",
    "set_state_dict_type",
    "sharded_dtensor",
    "sharded_registrations",
    "state_dict_type",
]

_CONFIGS: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


@dataclass
class _DictUnit:
    """State-dict bookkeeping of one unit module; see [Note: state dict hooks]."""

    state: UnitState
    settings: StateDictSettings
    segment: str  # "_fsdp_wrapped_module." for a wrapper, "" for a fully_shard module
    where: str  # how errors name the unit, e.g. "FullyShardedDataParallel(TinyGPT)"
    consumed: set[str] = field(default_factory=set)  # clean keys taken by the running load
    buffer_dtypes: list[tuple[str, torch.dtype]] = field(default_factory=list)  # raw relative key, dtype
    _keys: list[tuple[ShardedParam, list[str]]] | None = None
    module: nn.Module | None = None  # the module whose hooks these are (a unit of several modules has one each)

    def _paths(self) -> dict[int, list[str]]:
        paths: dict[int, list[str]] = {}
        root = self.module if self.module is not None else self.state.module
        for path, module in root.named_modules(remove_duplicate=False):
            paths.setdefault(id(module), []).append(path + "." if path else "")
        return paths

    def param_keys(self) -> list[tuple[ShardedParam, list[str]]]:
        """Each own parameter with its raw keys relative to the unit module (several when tied)."""
        if self._keys is None:
            group = self.state.group
            paths = self._paths()
            params = [] if group is None else group.params
            self._keys = [
                (sp, [base + name for module, name in sp.registrations for base in paths.get(id(module), [])])
                for sp in params
            ]
        return self._keys

    def extension_keys(self, extension: ExtensionParams) -> list[tuple[ExtensionParam, list[str]]]:
        """Each own extension parameter (see ``extension.py``) with its raw keys relative to the unit module."""
        paths = self._paths()
        return [
            (ep, [base + name for module, name in ep.registrations for base in paths.get(id(module), [])])
            for ep in extension.params
        ]

    def record_buffer_dtypes(self) -> None:
        """Remember the unit's floating-point buffers' dtypes before mixed precision casts them."""
        paths = self._paths()
        self.buffer_dtypes = [
            (base + name, buf.dtype)
            for module in self.state.own_modules
            for name, buf in module._buffers.items()
            if buf is not None and buf.is_floating_point()
            for base in paths.get(id(module), [])
        ]


# Kept in the unit module's __dict__, as its UnitState is (see engine/unit_state.py: a WeakKeyDictionary whose value
# refers to its key would never free the module).
_UNIT_ATTR = "_fullshard_state_dict_unit"


def install_state_dict_hooks(
    module: nn.Module, state: UnitState, *, default_type: StateDictType, segment: str, where: str
) -> None:
    """Attach the hooks of [Note: state dict hooks] to the unit ``module``; ``default_type`` is in force until set."""
    model_cfg, optim_cfg = _CONFIGS[default_type]
    unit = _DictUnit(state, StateDictSettings(default_type, model_cfg(), optim_cfg()), segment, where, module=module)
    unit.record_buffer_dtypes()
    module.__dict__[_UNIT_ATTR] = unit
    module.register_state_dict_post_hook(_post_state_dict)
    module.register_load_state_dict_pre_hook(_pre_load)
    module.register_load_state_dict_post_hook(_post_load)


def _unit(module: nn.Module) -> _DictUnit:
    unit = module.__dict__.get(_UNIT_ATTR)
    if unit is None:
        raise AssertionError(
            f"[rank {global_rank()}] {type(module).__name__}: state dict hook on a module without a unit"
        )
    return unit


def _units_in(module: nn.Module, caller: str) -> list[_DictUnit]:
    units = [u for m in module.modules() if (u := m.__dict__.get(_UNIT_ATTR)) is not None]
    if not units:
        raise ValueError(
            f"{caller}(module={type(module).__name__}): the module holds no sharded unit. Pass the model after "
            "wrapping it with FullyShardedDataParallel or fully_shard."
        )
    return units


# --- settings -----------------------------------------------------------------------------------------


def _coerce_config(config: Any, wanted: type, base: type, arg: str, type_name: str) -> Any:
    """``config`` as ``wanted``: ours, the base class (its fields carried over), or torch's class of that name."""
    if config is None:
        return wanted()
    if type(config) is wanted:
        return config
    if type(config).__name__ in (wanted.__name__, base.__name__):
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(wanted) if hasattr(config, f.name)}
        return wanted(**values)
    raise ValueError(
        f"set_state_dict_type({arg}={type(config).__name__}(...)): {type_name} takes a {wanted.__name__} "
        f"(or a plain {base.__name__}). Pass {wanted.__name__}(...) or leave {arg} unset for the defaults."
    )


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType | str,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> StateDictSettings:
    """Set the state dict type and configs of every unit in ``module``; return the settings in force before.

    Unset configs take their type's defaults. The previous settings returned are the first unit's.
    """
    units = _units_in(module, "set_state_dict_type")
    kind = coerce_enum(state_dict_type, StateDictType, arg="state_dict_type", allow_int=True)
    model_cls, optim_cls = _CONFIGS[kind]
    settings = StateDictSettings(
        kind,
        _coerce_config(state_dict_config, model_cls, StateDictConfig, "state_dict_config", kind.name),
        _coerce_config(optim_state_dict_config, optim_cls, OptimStateDictConfig, "optim_state_dict_config", kind.name),
    )
    previous = units[0].settings
    for unit in units:
        unit.settings = settings
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The settings in force on the units of ``module``; raises ``AssertionError`` if the units disagree."""
    units = _units_in(module, "get_state_dict_type")
    settings = units[0].settings
    for unit in units[1:]:
        if unit.settings != settings:
            raise AssertionError(
                f"get_state_dict_type({type(module).__name__}): the units disagree: {units[0].where} has "
                f"{settings} but {unit.where} has {unit.settings}. Set one type for the whole model with "
                "FullyShardedDataParallel.set_state_dict_type(model, ...)."
            )
    return settings


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType | str,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> Iterator[None]:
    """:func:`set_state_dict_type` for the block; every unit gets its own previous settings back."""
    units = _units_in(module, "state_dict_type")
    previous = [u.settings for u in units]
    set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        for unit, settings in zip(units, previous):
            unit.settings = settings


# --- values -------------------------------------------------------------------------------------------


def sharded_dtensor(group: ParamGroup, sp: ShardedParam, local: torch.Tensor) -> DTensor:
    """``local`` (this rank's real rows of ``sp``) as a DTensor of ``sp``'s full shape on the unit's mesh."""
    if not sp.shape:
        raise ValueError(
            f"sharded state dict: parameter {sp.fqn!r} is 0-dimensional, which cannot be sharded on dim 0. "
            "Use StateDictType.FULL_STATE_DICT for this model, or make the parameter shape (1,)."
        )
    return group.dtensor_of(sp, local)


def rows_of(group: ParamGroup, sp: ShardedParam, value: torch.Tensor, key: str) -> torch.Tensor:
    """This rank's real rows (``layout.local_shape``) of ``value``: a full tensor or a DTensor of ``sp``'s shape.

    A DTensor on the sharded parameter's own mesh and placements gives its local tensor; any other is gathered
    first (a collective over its mesh, which every rank reaches in the same order). A tensor parallel
    parameter takes this rank's tp part of the full tensor first (see [Note: tensor parallel parameters]).
    """
    shape = tuple(value.shape)
    if shape != sp.shape:
        raise ValueError(
            f"{key}: the value has shape {shape} but the parameter has shape {sp.shape}. Load a state dict "
            "of the same architecture (full shapes, as the unwrapped model's state_dict() has)."
        )
    if isinstance(value, DTensor):
        shard_group = group.shard_group
        mesh, placements = (
            (shard_group.get_mesh(), group.placements_of(sp))
            if sp.tp is None
            else (sp.tp.spmd_mesh, sp.tp.spmd_placements)
        )
        if value.device_mesh == mesh and tuple(value.placements) == placements:
            return value.to_local()
        value = value.full_tensor()
    return sp.rows_of(sp.gathered_of_full(value))


# --- save ---------------------------------------------------------------------------------------------


def _post_state_dict(module: nn.Module, destination: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    unit = _unit(module)
    group = unit.state.group
    kind = unit.settings.state_dict_type
    config = unit.settings.state_dict_config
    if group is not None:
        _reshard_kept_gathered(unit.state, group)
        if kind is StateDictType.FULL_STATE_DICT:
            _save_full(unit, group, destination, prefix, config)
        elif kind is StateDictType.SHARDED_STATE_DICT:
            _save_sharded(unit, group, destination, prefix, config.offload_to_cpu)
        else:
            _save_local(unit, group, destination, prefix, config.offload_to_cpu)
        if group.extension is not None:
            _save_extension(unit, group.extension, destination, prefix, kind, config.offload_to_cpu)
    for key, dtype in unit.buffer_dtypes:  # buffers cast by mixed precision are saved in their own dtype
        value = destination.get(prefix + key)
        if isinstance(value, torch.Tensor) and value.dtype != dtype:
            destination[prefix + key] = value.to(dtype)
    if kind is StateDictType.FULL_STATE_DICT and getattr(config, "rank0_only", False) and global_rank() != 0:
        for key in [k for k in destination if k.startswith(prefix)]:
            del destination[key]
    if unit.segment:
        _rename_prefix(destination, prefix + unit.segment, prefix)


def _reshard_kept_gathered(state: UnitState, group: ParamGroup) -> None:
    """A ``fully_shard`` unit still gathered after a forward (the root, ``reshard_after_forward=False``) is resharded
    by ``state_dict()``, as torch's ``fully_shard`` does before saving: ``parameters()`` yields the sharded ones again
    (a backward that follows gathers again). Not inside ``summon_full_params``, nor during forward or backward."""
    if (
        state.config.expose_gathered_after_forward
        and group.state is not ShardState.SHARDED
        and not group.summoned
        and state.training_state is TrainingState.IDLE
    ):
        group.reshard()


def _save_full(unit: _DictUnit, group: ParamGroup, out: dict[str, Any], prefix: str, config: Any) -> None:
    # Collectives over the shard group (and the tp mesh, for tensor parallel parameters): every rank, every
    # unit, in the same order.
    fulls = [sp.full_of_gathered(g) for sp, g in zip(group.params, group.gather_full())]
    if getattr(config, "rank0_only", False) and global_rank() != 0:
        return
    for (_, keys), full in zip(unit.param_keys(), fulls):
        value = full.cpu() if config.offload_to_cpu else full
        for key in keys:
            out[prefix + key] = value


def _save_sharded(unit: _DictUnit, group: ParamGroup, out: dict[str, Any], prefix: str, offload: bool) -> None:
    for sp, keys in unit.param_keys():
        local = sp.local_view(group.flat_shard).detach()
        value = sharded_dtensor(group, sp, local.cpu() if offload else local)
        for key in keys:
            out[prefix + key] = value


def _save_local(unit: _DictUnit, group: ParamGroup, out: dict[str, Any], prefix: str, offload: bool) -> None:
    for _, keys in unit.param_keys():
        for key in keys:
            out.pop(prefix + key, None)
    flat = group.flat_shard.detach()
    flat = flat.cpu() if offload else flat
    # a unit of mixed dtypes keeps its shards as bytes (see [Note: mixed dtypes] in group.py): saved as they are
    out[prefix + FLAT_PARAM] = group.shard_group.dtensor(flat, (group.shard_group.shard_size * flat.numel(),))


def _save_extension(
    unit: _DictUnit, ext: ExtensionParams, out: dict[str, Any], prefix: str, kind: StateDictType, offload: bool
) -> None:
    """Extension parameters (4-bit QLoRA weights): FULL gives each whole, in its own class (a collective); SHARDED
    a ``DTensor`` whose local tensor is this rank's shard (of that class); LOCAL is refused by name."""
    keyed = unit.extension_keys(ext)
    if kind is StateDictType.LOCAL_STATE_DICT:
        raise ValueError(
            f"{unit.where}: LOCAL_STATE_DICT of a unit holding quantized tensor-subclass parameters "
            f"({[keys[0] for _, keys in keyed]}): a flat shard cannot hold their quantization metadata. Use "
            "FULL_STATE_DICT or SHARDED_STATE_DICT, or save the adapters only (PEFT's save_pretrained)."
        )
    if kind is StateDictType.FULL_STATE_DICT:
        values = ext.full_copies()
    else:
        group = ext.shard_group
        values = [
            group.dtensor(ep.local.detach(), ep.shape) if ext.world > 1 else ep.local.detach() for ep in ext.params
        ]
    for (_, keys), value in zip(keyed, values):
        value = value.cpu() if offload and value.device.type != "cpu" else value
        for key in keys:
            out[prefix + key] = value


def _rename_prefix(destination: dict[str, Any], raw: str, clean: str) -> None:
    """Replace the leading ``raw`` of keys by ``clean``, keeping the order (and the ``_metadata`` keys)."""
    for mapping in (destination, getattr(destination, "_metadata", None)):
        if mapping is None or not any(k == raw[:-1] or k.startswith(raw) for k in mapping):
            continue
        items = list(mapping.items())
        mapping.clear()
        for key, value in items:
            if key == raw[:-1] or key.startswith(raw):  # the wrapper's own metadata key, or a key below it
                mapping[clean + key[len(raw) :] if key.startswith(raw) else clean[:-1]] = value
            else:
                mapping.setdefault(key, value)  # a renamed key keeps its place


# --- load ---------------------------------------------------------------------------------------------


def _pre_load(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    unit = _unit(module)
    if unit.segment:
        _insert_segment(state_dict, prefix, unit.segment)
    group = unit.state.group
    if group is None:
        return
    group.reshard()
    unit.consumed = set()
    flat_key = prefix + FLAT_PARAM
    if flat_key in state_dict:
        _load_local(group, state_dict.pop(flat_key), clean_key(flat_key))
        unit.consumed = {clean_key(prefix + k) for _, keys in unit.param_keys() for k in keys}
        return
    if group.is_meta and local_metadata.get("assign_to_params_buffers", False):
        _materialize_for(group, state_dict, prefix, unit)
    with torch.no_grad():
        for sp, keys in unit.param_keys():
            taken = _take(unit, state_dict, prefix, keys)
            if taken is not None:
                sp.local_view(group.flat_shard).copy_(rows_of(group, sp, taken[1], taken[0]))
    if group.extension is not None:
        for ep, keys in unit.extension_keys(group.extension):
            taken = _take(unit, state_dict, prefix, keys)
            if taken is not None:
                group.extension.load(ep, taken[1], taken[0])


def _take(unit: _DictUnit, state_dict: dict[str, Any], prefix: str, keys: list[str]) -> tuple[str, Any] | None:
    """Pop every present name of one parameter (a tied one has several) and mark them consumed; return the first
    one's clean key and value, or ``None`` if the state dict has none of them."""
    present = [prefix + k for k in keys if prefix + k in state_dict]
    if not present:
        return None
    values = [state_dict.pop(k) for k in present]
    unit.consumed.update(clean_key(k) for k in present)
    return clean_key(present[0]), values[0]


def _materialize_for(group: ParamGroup, state_dict: dict[str, Any], prefix: str, unit: _DictUnit) -> None:
    """``load_state_dict(assign=True)`` onto a unit still on ``meta``: the parameters take the loaded values, so the
    unit gets storage where they are (torch's ``fully_shard`` takes the assigned tensors as its sharded parameters)."""
    devices = {
        state_dict[prefix + k].device
        for _, keys in unit.param_keys()
        for k in keys
        if isinstance(state_dict.get(prefix + k), torch.Tensor) and not state_dict[prefix + k].is_meta
    }
    if len(devices) == 1:
        group.materialize(devices.pop())


def _insert_segment(state_dict: dict[str, Any], prefix: str, segment: str) -> None:
    """Move keys ``prefix + rest`` to ``prefix + segment + rest`` (not the unit's own ``_flat_param``)."""
    own = prefix + FLAT_PARAM
    moved = [k for k in state_dict if k.startswith(prefix) and k != own and not k.startswith(prefix + segment)]
    for key in moved:
        state_dict[prefix + segment + key[len(prefix) :]] = state_dict.pop(key)


def _load_local(group: ParamGroup, value: Any, key: str) -> None:
    local = value.to_local() if isinstance(value, DTensor) else value
    if not isinstance(local, torch.Tensor) or local.numel() != group.flat_shard.numel():
        got = tuple(local.shape) if isinstance(local, torch.Tensor) else type(local).__name__
        raise ValueError(
            f"{key}: a LOCAL_STATE_DICT flat shard of {got} elements, but this rank's shard of the unit holds "
            f"{group.flat_shard.numel()}. Local state dicts only load into the same model on the same number of ranks; "
            "use SHARDED_STATE_DICT or FULL_STATE_DICT to change either."
        )
    with torch.no_grad():
        group.flat_shard.copy_(local.reshape(-1))


def _post_load(module: nn.Module, incompatible: _IncompatibleKeys) -> None:
    unit = _unit(module)
    consumed, unit.consumed = unit.consumed, set()
    incompatible.missing_keys[:] = [k for k in map(clean_key, incompatible.missing_keys) if k not in consumed]
    incompatible.unexpected_keys[:] = [clean_key(k) for k in incompatible.unexpected_keys]


# --- checked load (the entry points' load_state_dict) -------------------------------------------------


def _listed(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:8])
    return f"[{shown}{', ...' if len(keys) > 8 else ''}] ({len(keys)})"


def load_checked(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    strict: bool,
    assign: bool,
    load: Callable[..., _IncompatibleKeys],
) -> _IncompatibleKeys:
    """Check ``state_dict`` against ``module`` (keys when ``strict``, shapes always), then ``load`` it.

    Raises ``RuntimeError`` before anything is copied, naming the missing and unexpected keys and the
    shape mismatches. Every rank checks the same dict, so every rank raises.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_state_dict(state_dict={type(state_dict).__name__}): expected a dict of name -> tensor.")
    missing, unexpected, shapes = mismatches(module, state_dict)
    problems = []
    if strict and missing:
        problems.append(f"missing keys {_listed(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected keys {_listed(unexpected)}")
    if shapes:
        problems.append(f"shape mismatches [{'; '.join(shapes[:8])}{'; ...' if len(shapes) > 8 else ''}]")
    if problems:
        where = _unit(module).where
        raise RuntimeError(
            f"{where}.load_state_dict(strict={strict}): the state dict does not match the model: "
            f"{'; '.join(problems)}. Load a state dict of this architecture, keyed as the unwrapped model's "
            "state_dict() is (FULL and SHARDED state dicts are)"
            + (", or pass strict=False to load only the keys present." if not shapes else ".")
        )
    return load(state_dict, strict=strict, assign=assign)

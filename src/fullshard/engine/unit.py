"""Turning one module into a unit: find its parameters, validate them, shard them, attach the state.

Both entry points (``FullyShardedDataParallel`` and ``fully_shard``) end here, so there is one engine.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fullshard.engine.api import Offload, PlacementError
from fullshard.engine.cpu_bf16 import warn_if_slow_bf16
from fullshard.engine.direct_calls import guard_direct_calls
from fullshard.engine.extension import ExtensionParams, is_plain, refuse_unshardable
from fullshard.engine.group import ParamGroup, main_dtype
from fullshard.engine.mesh import ShardGroup, simulating
from fullshard.engine.names import clean_key
from fullshard.engine.param import owner_label, replacement_for
from fullshard.engine.precision import Casts, group_precision
from fullshard.engine.unit_state import UnitConfig, UnitState, unit_state
from fullshard.ranks import global_rank, require_agreement

__all__ = ["Ignored", "InitOptions", "build_unit", "own_modules", "resolve_device", "resolve_ignored", "shard_dims"]


@dataclass(frozen=True)
class Ignored:
    """Modules and parameters a unit leaves alone: not sharded, their gradients not reduced."""

    module_ids: frozenset[int] = field(default_factory=frozenset)
    param_ids: frozenset[int] = field(default_factory=frozenset)


def resolve_ignored(
    root: nn.Module, ignored_modules: Iterable[nn.Module] | None, ignored_states: Iterable[object] | None
) -> Ignored:
    """Validate ``ignored_modules`` / ``ignored_states`` and collect what they cover."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "FullyShardedDataParallel got both ignored_modules and ignored_states; pass only one of them "
            "(ignored_states takes modules and parameters)."
        )
    modules: list[nn.Module] = []
    params: list[nn.Parameter] = []
    for item in list(ignored_modules or []) + list(ignored_states or []):
        if isinstance(item, nn.Parameter):
            params.append(item)
        elif isinstance(item, nn.Module):
            if unit_state(item) is not None:
                raise ValueError(
                    f"ignored module {type(item).__name__} is itself a sharded unit; ignore the module it wraps."
                )
            modules.append(item)
        else:
            raise TypeError(
                "ignored_modules/ignored_states must hold nn.Module or nn.Parameter objects, "
                f"got {type(item).__name__}."
            )
    for m in modules:
        params.extend(m.parameters())
    return Ignored(frozenset(id(m) for m in modules for m in m.modules()), frozenset(id(p) for p in params))


def resolve_device(device_id: int | torch.device | None, module: nn.Module) -> torch.device:
    """The compute device: ``device_id`` if given, else where the module is, else the backend's device."""
    if device_id is not None:
        if isinstance(device_id, int):
            return torch.device("cuda", device_id)
        if isinstance(device_id, (torch.device, str)):
            device = torch.device(device_id)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            return device
        raise TypeError(f"device_id={device_id!r} must be an int or a torch.device.")
    params = list(module.parameters())
    for p in params:
        if p.device.type not in ("cpu", "meta"):
            return p.device
    if params and simulating() and all(p.is_meta for p in params):
        return torch.device("meta")  # a planning run: nothing is allocated (see mesh.simulating)
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


Entry = tuple[str, list[tuple[nn.Module, str]], nn.Parameter]


def own_modules(unit_module: nn.Module, ignored: Ignored) -> list[tuple[str, nn.Module]]:
    """The modules of a unit with their prefixes: its tree, minus units below it and ignored modules."""
    found: list[tuple[str, nn.Module]] = []
    stack: list[tuple[str, nn.Module]] = [("", unit_module)]
    while stack:
        prefix, module = stack.pop()
        found.append((prefix, module))
        children = [
            (f"{prefix}{name}.", child)
            for name, child in module._modules.items()
            if child is not None and unit_state(child) is None and id(child) not in ignored.module_ids
        ]
        stack.extend(reversed(children))
    return found


def _collect(
    unit_module: nn.Module, modules: list[tuple[str, nn.Module]], ignored: Ignored
) -> tuple[list[Entry], list[tuple[str, nn.Module]]]:
    """The unit's own parameters (not those of units below it, nor ignored ones), and the modules holding them."""
    entries: dict[int, Entry] = {}
    holders: list[tuple[str, nn.Module]] = []
    for prefix, module in modules:
        holds = False
        for name, param in module._parameters.items():
            if param is None or id(param) in ignored.param_ids:
                continue
            fqn = clean_key(prefix + name)
            _refuse_taken(param, fqn)
            refuse_unshardable(param, fqn)
            if id(param) in entries:
                entries[id(param)][1].append((module, name))
            else:
                entries[id(param)] = (fqn, [(module, name)], param)
            holds = True
        if holds:
            holders.append((clean_key(prefix.rstrip(".")) or type(unit_module).__name__, module))
    return list(entries.values()), holders


def _refuse_taken(param: nn.Parameter, fqn: str) -> None:
    owner = owner_label(param)
    if owner is not None:
        raise ValueError(
            f"parameter {fqn!r} is already sharded by unit {owner!r}. Shard bottom-up: wrap submodules first, "
            "then their parents (fully_shard(layer) for each layer, then fully_shard(model))."
        )
    if replacement_for(param) is not None:
        raise ValueError(
            f"parameter {fqn!r} is shared (tied) with a parameter that a unit below this one already sharded. "
            "Tied parameters must live in one unit: don't wrap the submodule holding the other use separately "
            "(e.g. keep the embedding and the output head that share a weight both in the root unit), or untie them."
        )


@dataclass(frozen=True)
class InitOptions:
    """How a unit's parameters are initialised before sharding.

    Meta-device modules are materialized by ``param_init_fn`` when given, else (``to_empty`` then
    ``reset_parameters()``) when ``sync_module_states`` or ``materialize_meta`` (torch's FSDP1 default) asks
    for it; otherwise they stay on meta and are sharded there (torch's ``fully_shard``; see ``materialize.py``).
    """

    param_init_fn: Callable[[nn.Module], None] | None = None
    sync_module_states: bool = False
    materialize_meta: bool = True

    @property
    def materializes(self) -> bool:
        return self.param_init_fn is not None or self.sync_module_states or self.materialize_meta


def _materialize(modules: list[tuple[str, nn.Module]], device: torch.device, init: InitOptions) -> str | None:
    """Give meta-device modules of one unit real storage on ``device`` and initialise them.

    Only this unit's modules are materialized, so at most one unit is ever whole in memory during init.
    Returns what could not be initialised (a message), for the caller to raise where every rank will.
    """
    problem = None
    # Breadth-first, as torch's FSDP1 materializes: reset_parameters() draws random numbers, so the order
    # decides the values (a stable sort of the pre-order listing by depth is the breadth-first order).
    for prefix, module in sorted(modules, key=lambda item: item[0].count(".")):
        on_meta = any(t.is_meta for t in [*module._parameters.values(), *module._buffers.values()] if t is not None)
        if not on_meta:
            continue
        if init.param_init_fn is not None:
            init.param_init_fn(module)
            continue
        _to_empty_keeping_parameters(module, device)
        if init.sync_module_states and global_rank() != 0:
            continue  # rank 0's values arrive by broadcast
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        elif module._parameters and problem is None:
            where = clean_key(prefix.rstrip(".")) or "<root>"
            problem = (
                f"{type(module).__name__} at {where!r} is on the meta device and has no reset_parameters() to "
                "initialise it after materialization. Pass param_init_fn=... (called with each meta module), or "
                "build that module on a real device."
            )
    return problem


def _to_empty_keeping_parameters(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device=device, recurse=False)``, but each meta parameter keeps its identity.

    Leaving ``meta``, ``nn.Module._apply`` registers a new ``Parameter`` (meta and real tensors cannot share
    ``.data``). Anything that holds the old object would then hold a parameter the model no longer has: an
    optimizer built on a model that was on meta on ranks > 0 (transformers' ``Trainer`` creates its optimizer
    before preparing an FSDP2 model; it would never be switched to the shards, and those ranks would silently
    stop training), or a module that shares the parameter (a tied output head would come untied from its
    embedding). So plain parameters get storage in place (``torch.utils.swap_tensors``); the rest (buffers,
    parameter subclasses, parameters something holds a weak reference to) go through ``to_empty``.
    """
    for param in module._parameters.values():
        if param is not None and param.is_meta and type(param) is nn.Parameter and not weakref.getweakrefcount(param):
            real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, real)
    if any(t.is_meta for t in [*module._parameters.values(), *module._buffers.values()] if t is not None):
        module.to_empty(device=device, recurse=False)


def _broadcast_from_rank0(
    label: str, entries: list[Entry], modules: list[tuple[str, nn.Module]], problem: str | None
) -> None:
    """sync_module_states: every rank takes rank 0's parameters and buffers, after checking on every rank that
    no rank failed to initialise its modules (``problem``) and that the shapes agree."""
    tensors = [p for _, _, p in entries] + [b for _, m in modules for b in m._buffers.values() if b is not None]
    require_agreement(
        [(name, tuple(p.shape)) for name, _, p in entries],
        what=f"sync_module_states=True, unit {label!r}",
        problem=problem,
        describe=lambda rank, theirs, ours: f"rank {rank} has parameters {theirs}, but rank 0 has {ours}",
        remedy="Every rank must build the same model before wrapping",
    )
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=0)


def build_unit(
    module: nn.Module,
    shard_group: ShardGroup,
    config: UnitConfig,
    *,
    ignored: Ignored,
    use_dtensor: bool = False,
    guard_unit_module: bool = True,
    label: str | None = None,
    offload: Offload | None = None,
    init: InitOptions | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    members: Sequence[nn.Module] = (),
) -> UnitState:
    """Initialise ``module``'s own parameters if needed, shard them into a group, attach a :class:`UnitState`.

    ``members``: more modules whose own parameters join the group (``fully_shard([module, *members])``); their
    parameters are named ``<i>.name`` in the group (``i``: the member's place in the list)."""
    init = init or InitOptions()
    label = label or type(module).__name__
    modules = own_modules(module, ignored)
    for i, member in enumerate(members, start=1):
        modules += [(f"<{i}>.{prefix}", m) for prefix, m in own_modules(member, ignored)]
    device = shard_group.device
    problem = _materialize(modules, device, init) if init.materializes else None
    sync = init.sync_module_states and dist.get_world_size() > 1
    if problem is not None and not sync:
        raise ValueError(problem)
    for _, m in modules:
        for name, buf in m._buffers.items():
            if buf is not None and buf.device != device and not buf.is_meta:
                m._buffers[name] = buf.to(device)
    entries, holders = _collect(module, modules, ignored)
    for _, _, param in entries:
        if param.device != device and not param.is_meta:
            param.data = param.data.to(device)
    if sync:
        _broadcast_from_rank0(label, entries, modules, problem)
    every = entries
    trainable = [fqn for fqn, _, p in entries if not is_plain(p) and p.requires_grad]
    if trainable and not use_dtensor:
        raise ValueError(
            f"unit {label!r}: FullyShardedDataParallel does not train tensor-subclass parameters ({trainable}); "
            "fully_shard does (sharded as DTensors over the subclass's rows, gathered through its "
            "fsdp_pre_all_gather/fsdp_post_all_gather). Use fully_shard (FSDP2), or freeze them "
            "(param.requires_grad_(False))."
        )
    entries, extension = _split_extension(label, entries, shard_group)
    group = None
    handles = []
    if entries or extension is not None:
        precision = group_precision(config.casts, _unit_dtype(label, entries or every, config.casts))
        warn_if_slow_bf16(precision.param_dtype, device)
        dims = shard_dims(entries, shard_placement_fn, label)
        group = ParamGroup(
            label, entries, shard_group, precision, use_dtensor=use_dtensor, offload=offload, shard_dims=dims
        )
        group.extension = extension
        if extension is not None:  # None: the parameters' own dtype
            extension.param_dtype = config.casts.param_dtype
            extension.reduce_dtype = config.casts.reduce_dtype or config.casts.param_dtype
        if config.casts.keep_low_precision_grads:
            _allow_low_precision_grads(group)
        guarded = [(n, m) for n, m in holders if guard_unit_module or m is not module]
        handles = guard_direct_calls(label, group, guarded)
    state = UnitState(module, group, config, label, own_modules=[m for _, m in modules])
    for member in members:
        state.attach(member)
    state.keep_hooks(*handles)
    return state


def _split_extension(
    label: str, entries: list[Entry], shard_group: ShardGroup
) -> tuple[list[Entry], ExtensionParams | None]:
    """The plain parameters (for the group's flat shard) and the tensor-subclass ones, sharded here (see
    [Note: extension parameters] in ``extension.py``)."""
    plain = [e for e in entries if is_plain(e[2])]
    if len(plain) == len(entries):
        return entries, None
    if not plain and not any(e[2].requires_grad for e in entries):
        names = [fqn for fqn, _, _ in entries]
        raise ValueError(
            f"unit {label!r} holds only quantized tensor-subclass parameters ({names}); fullshard gathers those with "
            "a unit that also holds plain parameters. Wrap the module that holds them together with others (e.g. the "
            "decoder layer, not each quantized Linear), or leave them unsharded (ignored_params=...)."
        )
    return plain, ExtensionParams(label, [e for e in entries if not is_plain(e[2])], shard_group)


def _unit_dtype(label: str, entries: list[Entry], casts: Casts) -> torch.dtype:
    """The dtype of the unit's gradients (see [Note: mixed dtypes] in ``group.py``); parameters of several dtypes
    need one compute dtype to be gathered in."""
    params = [p for _, _, p in entries]
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1 and casts.param_dtype is None:
        names = ", ".join(f"{name}: {p.dtype}" for name, _, p in entries if p.dtype != params[0].dtype)
        raise ValueError(
            f"unit {label!r} mixes parameter dtypes ({sorted(map(str, dtypes))}; {names} differ from "
            f"{params[0].dtype}) without a compute dtype to gather them in. Set one: MixedPrecision(param_dtype=...) "
            "or MixedPrecisionPolicy(param_dtype=...) (Accelerator(mixed_precision='bf16')), or cast the module to "
            "one dtype before wrapping, or wrap the differing submodules separately."
        )
    try:
        return main_dtype(params)
    except ValueError as err:
        raise ValueError(f"unit {label!r}: {err}") from None


def shard_dims(
    entries: list[Entry], shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None, label: str
) -> list[int] | None:
    """Per parameter, the dim ``shard_placement_fn`` shards it on (``None`` from it: dim 0), checked; ``None`` when
    every dim is 0. See [Note: Shard(d)] in ``param.py``."""
    if shard_placement_fn is None:
        return None
    dims = []
    for fqn, _, param in entries:
        placement = shard_placement_fn(param)
        if placement is None:
            dims.append(0)
            continue
        if not isinstance(placement, Shard) or type(placement) is not Shard:
            raise ValueError(
                f"fully_shard({label}): shard_placement_fn returned {placement!r} for parameter {fqn!r}; it must "
                "return Shard(dim) (torch.distributed.tensor.Shard) or None (Shard(0))."
            )
        ndim = max(param.dim(), 1)
        dim = placement.dim + ndim if placement.dim < 0 else placement.dim
        if not 0 <= dim < ndim:
            raise PlacementError(
                f"Shard dim {placement.dim} is invalid for {ndim}D tensor: fully_shard({label})'s shard_placement_fn "
                f"returned Shard({placement.dim}) for parameter {fqn!r} of shape {tuple(param.shape)}. Return Shard(d) "
                f"with -{ndim} <= d < {ndim} for it (or None for Shard(0))."
            )
        if dim and isinstance(param, DTensor):
            raise ValueError(
                f"fully_shard({label}): shard_placement_fn returned Shard({dim}) for parameter {fqn!r}, a tensor "
                "parallel DTensor; fullshard shards tensor parallel parameters on dim 0 only. Return Shard(0) or None "
                "for DTensor parameters."
            )
        dims.append(dim)
    return dims if any(dims) else None


def _allow_low_precision_grads(group: ParamGroup) -> None:
    """keep_low_precision_grads: let the sharded parameters hold gradients in the reduce dtype."""
    for sp in group.params:
        if not hasattr(sp.sharded_param, "grad_dtype"):
            raise ValueError(
                "MixedPrecision(keep_low_precision_grads=True) needs torch >= 2.10 (Tensor.grad_dtype) so that a "
                f"{sp.dtype} parameter may hold a {group.precision.grad_dtype} gradient; upgrade torch or leave it off."
            )
        sp.sharded_param.grad_dtype = group.precision.grad_dtype

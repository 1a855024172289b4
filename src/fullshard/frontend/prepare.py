"""Sharding a model the way the plugin says: ``fsdp_version=1`` wrapper or ``fsdp_version=2`` ``fully_shard``.

Also Accelerate's FSDP2 helpers under their names (``fsdp2_prepare_model``, ``fsdp2_prepare_auto_wrap_policy``,
``fsdp2_load_full_state_dict``, ``fsdp2_switch_optimizer_parameters``) and the RAM-efficient-loading switches.

The plugin is resolved once, into a ``ShardingPlan`` (:func:`resolve_plan`), and the engine shards by that plan
alone (``algorithms/plan.py``), one unit at a time: mixed precision, CPU offload, ``param_init_fn`` and
``sync_module_states`` go to ``FullyShardedDataParallel`` and to ``fully_shard`` (which takes the last two as
fullshard's extensions of torch's signature; see [Note: RAM-efficient loading]). Activation checkpointing is
``algorithms/checkpointing.checkpoint_module`` on the blocks the auto-wrap policy selects.

[Note: RAM-efficient loading]
With ``cpu_ram_efficient_loading`` (which forces ``sync_module_states``) only rank 0 reads the pretrained
weights; the other ranks build the model on the ``meta`` device. Sharding then goes unit by unit, innermost
first: ranks > 0 give the unit's own modules empty storage (``to_empty``, each parameter keeping its identity,
so an optimizer built on the meta model still finds its shards), rank 0 broadcasts the unit's
parameters and buffers, and the unit is sharded at once, which frees the full tensors. So a rank > 0 holds at
most one unit in full (plus the shards of the units done), never the whole model.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.algorithms.full_load import load_full_state_dict
from fullshard.algorithms.plan import ShardingPlan, apply_plan, plan_sharding
from fullshard.algorithms.whole_step import is_matrix_optimizer, whole_param_step
from fullshard.engine import InitOptions, is_unit, replacement_for, retired_data_ptr
from fullshard.frontend import env
from fullshard.frontend.adapters import save_adapters_whole
from fullshard.frontend.plugin import FullyShardedDataParallelPlugin
from fullshard.ranks import first_difference, require_agreement

__all__ = [
    "get_parameters_from_modules",
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_auto_wrap_policy",
    "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters",
    "is_sharded",
    "prepare_model",
    "prepare_whole_param_step",
    "switch_optimizer_to_sharded",
]


def enable_fsdp_ram_efficient_loading() -> None:
    """Tell ``transformers``' ``from_pretrained`` (through the environment) to load weights on rank 0 only."""
    os.environ.setdefault(env.by_field("use_fsdp", env.LAUNCH_VARS).env, "True")
    env.write_field("cpu_ram_efficient_loading", True)


def disable_fsdp_ram_efficient_loading() -> None:
    """Undo :func:`enable_fsdp_ram_efficient_loading`: every rank loads the weights."""
    env.write_field("cpu_ram_efficient_loading", False)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is already a unit (a ``FullyShardedDataParallel`` or a ``fully_shard`` module)."""
    return is_unit(model)


def _check_plugin(plugin: object, where: str) -> FullyShardedDataParallelPlugin:
    if not isinstance(plugin, FullyShardedDataParallelPlugin):
        raise TypeError(
            f"{where}: expected a FullyShardedDataParallelPlugin, got {type(plugin).__name__}. "
            "Create the Accelerator with fsdp_plugin=FullyShardedDataParallelPlugin(...)."
        )
    return plugin


def fsdp2_prepare_auto_wrap_policy(
    fsdp2_plugin: FullyShardedDataParallelPlugin, model: nn.Module
) -> Callable[[nn.Module], bool] | None:
    """The plugin's auto-wrap policy bound to ``model``, as ``policy(module) -> bool`` (``None``: no wrap)."""
    plugin = _check_plugin(fsdp2_plugin, "fsdp2_prepare_auto_wrap_policy(fsdp2_plugin=...)")
    plugin.set_auto_wrap_policy(model)
    policy = plugin.auto_wrap_policy
    if policy is None:
        return None
    bound: Callable[..., Any] = policy

    def select(module: nn.Module) -> bool:
        return bool(bound(module, False, sum(p.numel() for p in module.parameters())))

    return select


def resolve_plan(plugin: FullyShardedDataParallelPlugin, model: nn.Module, device: torch.device | None) -> ShardingPlan:
    """The plugin's settings for ``model``, resolved once into a :class:`ShardingPlan`.

    Binds a name-based auto-wrap policy to ``model``'s classes (as Accelerate's ``set_auto_wrap_policy`` does, on
    the plugin), finds the ignored modules, and applies the policy once. ``device`` is the compute device (given
    to the ``fsdp_version=1`` wrapper as ``device_id`` on CUDA).
    """
    plugin.set_auto_wrap_policy(model)
    init = InitOptions(plugin.param_init_fn, bool(plugin.sync_module_states))
    options = plugin.entry_options()
    if plugin.fsdp_version == 1 and device is not None and device.type == "cuda":
        options["device_id"] = device
    return plan_sharding(
        model,
        version=int(plugin.fsdp_version),  # type: ignore[arg-type]
        auto_wrap_policy=plugin.auto_wrap_policy,  # type: ignore[arg-type]
        ignored_modules=plugin.resolve_ignored_modules(model),
        precision=_unit_input_casts(plugin),
        offload=plugin.cpu_offload,
        init=init,
        activation_checkpointing=bool(plugin.activation_checkpointing),
        **options,
    )


def _unit_input_casts(plugin: FullyShardedDataParallelPlugin) -> Any:
    """The plugin's precision policy, with every ``fsdp_version=1`` unit casting its inputs to ``param_dtype``.

    [Note: unit inputs under the Accelerator] Accelerate runs the whole forward under ``torch.autocast``, so a
    unit that meets an input in another dtype than its gathered parameters still computes. The Accelerator here
    skips autocast when the policy sets ``param_dtype`` (``training.needs_autocast``), so a unit's inputs must
    arrive in its compute dtype. PEFT breaks that: it casts an adapter's input to ``lora_A.weight.dtype``, read
    outside the unit, i.e. the sharded fp32 weight, while the unit computes with bf16 gathered weights. FSDP2's
    policy casts every unit's inputs by default (``cast_forward_inputs=True``); FSDP1's only the root's, so the
    Accelerator turns it on for FSDP1 too. The plugin's own policy object stays Accelerate's value.
    """
    policy = plugin.mixed_precision_policy
    if plugin.fsdp_version != 1 or getattr(policy, "param_dtype", None) is None or policy.cast_forward_inputs:
        return policy
    return dataclasses.replace(policy, cast_forward_inputs=True)


def get_parameters_from_modules(
    modules: Iterable[nn.Module] | str | None, model: nn.Module, device: torch.device | str | None
) -> set[nn.Parameter]:
    """The parameters of ``modules`` (``None``: none; a string: the modules of ``model`` whose names match it in
    full, moved to ``device`` as Accelerate does), as a set."""
    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        modules = [m.to(device) for name, m in model.named_modules() if pattern.fullmatch(name)]
    return {p for module in modules for p in module.parameters()}


def fsdp2_prepare_model(accelerator: Any, model: nn.Module) -> nn.Module:
    """``fully_shard`` every block the plugin's policy selects, then the root; returns ``model`` (changed in place).

    ``accelerator`` supplies ``state.fsdp_plugin`` (or ``fsdp_plugin``). With ``param_init_fn`` or
    ``sync_module_states``, meta-device modules are materialized (and, with the latter, given rank 0's values)
    one unit at a time (see the module docstring); without either they stay on meta, as with Accelerate, for
    the caller's ``to_empty`` and init. Activation checkpointing is left to the caller, as Accelerate does.
    """
    plugin = _plugin_of(accelerator, "fsdp2_prepare_model")
    if plugin.fsdp_version != 2:
        raise ValueError(
            f"fsdp2_prepare_model(accelerator=...) with fsdp_version={plugin.fsdp_version}: this helper applies "
            "fully_shard (fsdp_version=2). Use Accelerator.prepare(model) for fsdp_version=1."
        )
    plan = resolve_plan(plugin, model, None)
    return _apply(model, dataclasses.replace(plan, checkpointed=()))


def _plugin_of(accelerator: Any, where: str) -> FullyShardedDataParallelPlugin:
    plugin = getattr(accelerator, "fsdp_plugin", None) or getattr(
        getattr(accelerator, "state", None), "fsdp_plugin", None
    )
    return _check_plugin(plugin, f"{where}(accelerator=...)")


def _apply(model: nn.Module, plan: ShardingPlan) -> nn.Module:
    """Check the whole model across ranks before any unit broadcasts (``sync_module_states``), then shard it."""
    if plan.init.sync_module_states and dist.get_world_size() > 1:
        _check_before_sync(model, plan.init.param_init_fn)
    sharded = apply_plan(model, plan)
    save_adapters_whole(sharded)  # a PEFT model's save_pretrained: [Note: saving a sharded adapter] in adapters.py
    return sharded


def _check_before_sync(model: nn.Module, param_init_fn: Callable[[nn.Module], None] | None) -> None:
    """Raise on every rank, before any broadcast, if the ranks built models of different shapes, or if rank 0
    has meta modules it cannot initialise (no ``param_init_fn`` and no ``reset_parameters()``)."""
    signature = [(name, tuple(t.shape)) for name, t in [*model.named_parameters(), *model.named_buffers()]]
    stuck = None
    if dist.get_rank() == 0 and param_init_fn is None:
        names = [name or "<root>" for name, m in model.named_modules()
                 if _holds_meta(m) and m._parameters and not hasattr(m, "reset_parameters")]  # fmt: skip
        stuck = names and (
            f"{names[:3]} are on the meta device and have no reset_parameters() to initialise them before they are "
            "broadcast. Build the model on a real device on rank 0 (only the other ranks may use meta), or pass "
            "FullyShardedDataParallelPlugin(param_init_fn=...)."
        )

    def describe(rank: int, theirs: list[Any], ours: list[Any]) -> str:
        _, mine, other = first_difference(ours, theirs)
        return f"rank {rank} built a different model than rank 0 (first difference: {other} vs rank 0's {mine})"

    require_agreement(
        signature,
        what=f"sync_module_states=True (model={type(model).__name__})",
        problem=stuck or None,
        describe=describe,
        remedy="Every rank must build the same architecture; with cpu_ram_efficient_loading only the weights may "
        "differ (ranks > 0 on meta)",
    )


def _holds_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module._parameters.values(), *module._buffers.values()] if t is not None)


def _check_activation_checkpointing(plugin: FullyShardedDataParallelPlugin) -> None:
    if plugin.activation_checkpointing and plugin.auto_wrap_policy is None:
        raise ValueError(
            "FullyShardedDataParallelPlugin(activation_checkpointing=True, auto_wrap_policy=None): the blocks to "
            "recompute are the ones the auto-wrap policy selects. Pass auto_wrap_policy='transformer_based_wrap' "
            "(with transformer_cls_names_to_wrap) or 'size_based_wrap'."
        )


def prepare_model(
    model: nn.Module,
    plugin: FullyShardedDataParallelPlugin,
    device: torch.device,
    *,
    mesh: Any = None,
    tp_mesh: Any = None,
) -> nn.Module:
    """Shard ``model`` as ``plugin`` says; a model that is already sharded is returned as it is.

    One trip down: the plugin is resolved once (:func:`resolve_plan`) and the engine shards by that plan.
    ``mesh`` and ``tp_mesh`` (a ``ParallelismConfig``'s, ``fsdp_version=2`` only) go to every ``fully_shard``.
    """
    if is_sharded(model):
        return model
    _check_activation_checkpointing(plugin)
    plan = resolve_plan(plugin, model, device)
    if mesh is not None:
        plan = dataclasses.replace(plan, options={**plan.options, "mesh": mesh, "tp_mesh": tp_mesh})
    return _apply(model, plan)


def fsdp2_switch_optimizer_parameters(optimizer: torch.optim.Optimizer, mapping: Mapping[Any, Any]) -> None:
    """Replace every parameter of ``optimizer`` by its entry in ``mapping``, in place, keeping the param groups.

    Each optimizer parameter ``p`` is looked up as Accelerate looks it up, by ``p.data_ptr`` (the integer address
    Accelerate's ``prepare`` writes onto its placeholders, or else the bound method, which a mapping keyed by
    ``p.data_ptr`` holds), then by the parameter object itself, then by the address its data had before sharding
    freed it, then by its current address. The keys of one mapping may mix these kinds. Raises ``KeyError``
    naming the first parameter with no entry: keeping it would leave a parameter that is never updated, so the
    training would silently be wrong.
    """
    lookup = _ParameterKeys(mapping)
    for index, group in enumerate(optimizer.param_groups):
        switched = []
        for position, param in enumerate(group["params"]):
            replacement = lookup.find(param)
            if replacement is None:
                raise KeyError(
                    f"fsdp2_switch_optimizer_parameters: parameter {position} of param group {index} "
                    f"(a {type(param).__name__} of dtype {param.dtype}) has no sharded replacement in mapping "
                    "(looked up by its data_ptr attribute, the parameter object and its data_ptr() before and "
                    "after sharding). Every parameter of the optimizer must belong to the model being sharded; "
                    "create the optimizer from model.parameters() of that model, or after sharding it."
                )
            switched.append(replacement)
        group["params"] = switched


class _ParameterKeys:
    """``mapping`` split by key kind, so that a tensor is never compared with an integer key (tensors hash by
    identity, and ``==`` between a tensor and an int is elementwise)."""

    def __init__(self, mapping: Mapping[Any, Any]) -> None:
        self.by_address: dict[int, Any] = {}
        self.by_identity: dict[int, Any] = {}
        for key, value in mapping.items():
            if isinstance(key, int) and not isinstance(key, bool):
                self.by_address[key] = value
            elif isinstance(key, torch.Tensor):
                self.by_identity[id(key)] = value
            elif isinstance(getattr(key, "__self__", None), torch.Tensor):  # keyed by p.data_ptr (a bound method)
                self.by_identity[id(key.__self__)] = value

    def find(self, param: torch.Tensor) -> Any:
        attribute = param.__dict__.get("data_ptr")  # Accelerate's placeholders carry the original's address
        if isinstance(attribute, int) and attribute in self.by_address:
            return self.by_address[attribute]
        if id(param) in self.by_identity:
            return self.by_identity[id(param)]
        local = getattr(param, "_local_tensor", param)  # a DTensor's address is its local tensor's (as Accelerate)
        for address in (retired_data_ptr(param), torch.Tensor.data_ptr(local)):  # not local.data_ptr: shadowed
            if address is not None and address in self.by_address:
                return self.by_address[address]
        return None


def switch_optimizer_to_sharded(optimizer: torch.optim.Optimizer) -> int:
    """Switch the parameters of an optimizer created before sharding onto the sharded ones; return how many.

    An optimizer that already holds sharded (or never-sharded) parameters is left as it is. Raises ``KeyError``
    through :func:`fsdp2_switch_optimizer_parameters` when it mixes originals with unknown parameters.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    mapping = {p: r for p in params if (r := replacement_for(p)) is not None}
    if not mapping:
        return 0
    if len(mapping) != len(params):
        mapping.update({p: p for p in params if p not in mapping and p.numel() > 0})
    fsdp2_switch_optimizer_parameters(optimizer, mapping)
    if optimizer.state:
        raise ValueError(
            f"Accelerator.prepare({type(optimizer).__name__}): the optimizer already holds state for the original "
            "parameters (it has stepped), which cannot be resharded. Prepare it before the first step."
        )
    return len(mapping)


def prepare_whole_param_step(optimizer: torch.optim.Optimizer, models: list[nn.Module], on: bool) -> bool:
    """Turn on whole-parameter steps for a matrix optimizer (``algorithms/whole_step.py``) over one of ``models``
    when the plugin's ``whole_param_step`` is ``on``; return whether it did. Off, such an optimizer refuses to step."""
    if not on or not is_matrix_optimizer(optimizer):
        return False
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in reversed(models):  # the latest prepared model that holds the optimizer's parameters
        if ids & {id(p) for p in model.parameters()}:
            whole_param_step(model, optimizer)
            return True
    return False


def fsdp2_load_full_state_dict(accelerator: Any, model: nn.Module, full_sd: Mapping[str, torch.Tensor]) -> None:
    """Load a full state dict held by rank 0 into the sharded ``model`` in place; other ranks pass ``{}``.

    The one rank-0 → shards path (``algorithms/full_load.py``): rank 0 raises first, on every rank, naming keys
    that are missing or differ in shape (keys the model lacks are ignored); then every rank receives its rows.
    """
    del accelerator  # Accelerate's signature; the model carries its meshes
    _materialize_meta(model)
    load_full_state_dict(model, full_sd, strict=False, caller="fsdp2_load_full_state_dict(full_sd=...)")


def _materialize_meta(model: nn.Module) -> None:
    """A model ``fully_shard`` left on ``meta`` gets storage (``to_empty``) on its shards' device before loading."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta for t in tensors):
        return
    mesh = next((t.device_mesh for t in tensors if hasattr(t, "device_mesh")), None)
    device_type = mesh.device_type if mesh is not None else "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)
    model.to_empty(device=device)

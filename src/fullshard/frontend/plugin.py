"""``FullyShardedDataParallelPlugin``: the FSDP settings of a training run, as Accelerate's plugin takes them.

Every field of Accelerate's plugin is here with its default and meaning. A field left ``None`` is
filled from the ``FSDP_*`` environment that ``fullshard launch`` (or ``accelerate launch``) set, through the
table in :mod:`fullshard.frontend.env`; an explicit argument always wins over the environment. After
construction every field holds a typed value (enums and config objects, never strings):

- ``fsdp_version=1``: ``sharding_strategy`` is a :class:`ShardingStrategy` and ``reshard_after_forward`` the
  same strategy. ``fsdp_version=2`` (as Accelerate's): ``sharding_strategy`` is ``None`` and
  ``reshard_after_forward`` a ``bool`` (``FULL_SHARD`` ↔ ``True``, ``SHARD_GRAD_OP`` ↔ ``False``; a strategy
  passed for version 2 is converted, with a warning), and ``backward_prefetch`` is ``None`` (``fully_shard``
  prefetches on its own; a value passed is dropped with a warning).
- ``cpu_offload`` is a :class:`CPUOffload` (version 1) or an :class:`OffloadPolicy` (version 2).
- ``mixed_precision_policy`` is ``None``, a :class:`MixedPrecision` (1) or a :class:`MixedPrecisionPolicy` (2).
- ``auto_wrap_policy`` is ``None`` (no wrap), a policy callable, or one of the engine's
  ``transformer_auto_wrap_policy`` / ``size_based_auto_wrap_policy`` until :meth:`set_auto_wrap_policy`
  binds it to a model's classes.

The plugin only describes; :meth:`FullyShardedDataParallelPlugin.fsdp_kwargs` and
:meth:`FullyShardedDataParallelPlugin.fully_shard_kwargs` hand the settings to the engine as plain keyword
arguments. torch's own config objects (``torch.distributed.fsdp.FullStateDictConfig``, ...) are accepted and
converted to ours by field name, so code written for Accelerate keeps working after changing its imports.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fullshard.engine import (
    INVARIANT_ENV,
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictType,
    resolve_invariant_micro_batches,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from fullshard.frontend import env
from fullshard.frontend import plugin_values as values

__all__ = ["FullyShardedDataParallelPlugin", "get_module_class_from_name"]

_PLUGIN = values.PLUGIN
# state_dict_type → (model config class, optim config class, default model config, default optim config)
_STATE_DICT_KINDS: dict[StateDictType, tuple[type, type, StateDictConfig, OptimStateDictConfig]] = {
    StateDictType.FULL_STATE_DICT: (
        FullStateDictConfig,
        FullOptimStateDictConfig,
        FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    ),
    StateDictType.SHARDED_STATE_DICT: (
        ShardedStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig(offload_to_cpu=True),
        ShardedOptimStateDictConfig(offload_to_cpu=True),
    ),
    StateDictType.LOCAL_STATE_DICT: (
        LocalStateDictConfig,
        LocalOptimStateDictConfig,
        LocalStateDictConfig(),
        LocalOptimStateDictConfig(),
    ),
}
_BOOL_FIELDS = (
    "limit_all_gathers",
    "use_orig_params",
    "sync_module_states",
    "forward_prefetch",
    "activation_checkpointing",
    "cpu_ram_efficient_loading",
    "whole_param_step",
)


@dataclass
class FullyShardedDataParallelPlugin:
    """The FSDP settings of a run (Accelerate's ``FullyShardedDataParallelPlugin``, same fields and defaults)."""

    fsdp_version: int | None = None
    """1 (``FullyShardedDataParallel`` wrapper) or 2 (per-module ``fully_shard``). Default 1."""
    sharding_strategy: str | ShardingStrategy | None = None
    """How parameters, gradients and optimizer states are split (name, number 1-5 or enum). Default FULL_SHARD.
    Superseded by ``reshard_after_forward``; both are kept consistent. Always ``None`` for version 2."""
    reshard_after_forward: str | ShardingStrategy | bool | None = None
    """Free gathered parameters after forward: a bool (version 2) or a strategy (version 1). Default
    ``FULL_SHARD`` / ``True``. ``True`` ↔ FULL_SHARD and ``False`` ↔ SHARD_GRAD_OP in both versions."""
    backward_prefetch: str | BackwardPrefetch | None = None
    """When the next unit is gathered in backward: BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH (``None``,
    the default). Version 1 only: version 2 drops it (``fully_shard`` prefetches on its own)."""
    mixed_precision_policy: dict[str, Any] | str | MixedPrecision | MixedPrecisionPolicy | None = None
    """``None`` (full precision), "fp16"/"bf16"/"fp32", a dict of dtypes (``param_dtype``, ``reduce_dtype``,
    and ``buffer_dtype`` (v1) or ``output_dtype`` (v2)), or a ``MixedPrecision`` (v1) / ``MixedPrecisionPolicy``
    (v2)."""
    auto_wrap_policy: Callable[..., Any] | str | None = None
    """"transformer_based_wrap", "size_based_wrap", "no_wrap" (default) or a policy callable."""
    cpu_offload: bool | CPUOffload | OffloadPolicy | None = None
    """Keep sharded parameters and gradients on the CPU: a bool, ``CPUOffload`` (v1) or ``CPUOffloadPolicy``
    (v2). Default ``False``."""
    ignored_modules: Iterable[nn.Module] | str | None = None
    """Modules left unsharded: the modules themselves, or a regex matched (fullmatch) against module names."""
    state_dict_type: str | StateDictType | None = None
    """FULL_STATE_DICT (default for version 1), SHARDED_STATE_DICT (default for version 2) or
    LOCAL_STATE_DICT (version 1 only)."""
    state_dict_config: StateDictConfig | None = None
    """Config of the model state dict; derived from ``state_dict_type`` when ``None``."""
    optim_state_dict_config: OptimStateDictConfig | None = None
    """Config of the optimizer state dict; derived from ``state_dict_type`` when ``None``."""
    limit_all_gathers: bool = True
    """Limit in-flight all-gathers (version 1)."""
    use_orig_params: bool | None = None
    """Let the optimizer see the original parameters (version 1; version 2 always does). Default ``False``."""
    param_init_fn: Callable[[nn.Module], None] | None = None
    """Materialises modules on the meta device, e.g. ``lambda m: m.to_empty(device=d, recurse=False)``."""
    sync_module_states: bool | None = None
    """Broadcast parameters and buffers from rank 0 when wrapping. Default ``False``; forced ``True`` by
    ``cpu_ram_efficient_loading``."""
    forward_prefetch: bool | None = None
    """Issue the next unit's all-gather during forward (static graphs only). Default ``False``."""
    activation_checkpointing: bool | None = None
    """Recompute activations of the wrapped blocks in backward instead of storing them. Default ``False``."""
    cpu_ram_efficient_loading: bool | None = None
    """Only rank 0 loads pretrained weights; the others get them by broadcast. Default ``False``."""
    transformer_cls_names_to_wrap: list[str] | None = None
    """Class names of the blocks ``transformer_based_wrap`` makes units; default: the model's
    ``_no_split_modules``."""
    min_num_params: int | None = None
    """Smallest unit for ``size_based_wrap`` (0 turns wrapping off). Default 100,000,000."""
    invariant_micro_batches: int | None = None
    """fullshard's addition: world-size-invariant mode with ``G`` micro-batches per optimizer step (a power of two,
    a multiple of every world size the run will use): the weights after every step are bitwise the same on any
    number of ranks. ``None`` (the default) or 0: off. Read from ``FSDP_INVARIANT_MICRO_BATCHES``, else the
    engine's ``FULLSHARD_INVARIANT_MICRO_BATCHES``. The Accelerator then deals micro-batches, accumulates
    ``G / N`` of them per rank and seeds each one's randomness (see ``frontend/invariant.py``)."""
    whole_param_step: bool | None = None
    """fullshard's addition: ``prepare`` steps a matrix optimizer (``torch.optim.Muon``, ``torch.optim.Adafactor``,
    a class given to ``fullshard.register_matrix_optimizer``) on whole parameters, each on one owning rank, so its
    weights are the unsharded optimizer's (``fullshard.whole_param_step``; docs/design.md, "Matrix optimizers").
    Default ``True``; ``False`` leaves it off, and such an optimizer then refuses to step on shards. Read from
    ``FSDP_WHOLE_PARAM_STEP``."""

    def __post_init__(self) -> None:
        given = {f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        from_env = env.read_env()
        self.fsdp_version = values.parse_version(
            self.fsdp_version if "fsdp_version" in given else from_env.get("fsdp_version")
        )
        _resolve_sharding(self, from_env)
        for name, value in from_env.items():
            if name not in given and name not in ("fsdp_version", "sharding_strategy", "reshard_after_forward"):
                setattr(self, name, value)
        _parse_fields(self)
        self.invariant_micro_batches = _resolve_invariant(
            self.invariant_micro_batches, "invariant_micro_batches" in given
        )
        _check_state_dict_configs(self, type_given="state_dict_type" in given)
        self.set_state_dict_type()
        _apply_cpu_ram_efficient_loading(self, given)
        if self.mixed_precision_policy is not None:
            self._parse_mixed_precision_policy()
            self.validate_mixed_precision_policy()

    # --- Accelerate's methods ---------------------------------------------------------------------------

    def set_state_dict_type(self, state_dict_type: str | StateDictType | None = None) -> None:
        """Set ``state_dict_type`` (if given) and derive the configs that do not match it.

        Configs of the right kind are kept; ``None`` or another kind's config is replaced by the default:
        full → ``offload_to_cpu=True, rank0_only=True``; sharded → ``offload_to_cpu=True``.
        """
        if state_dict_type is not None:
            self.state_dict_type = state_dict_type
        if self.state_dict_type is None:
            self.state_dict_type = "FULL_STATE_DICT" if self.fsdp_version == 1 else "SHARDED_STATE_DICT"
        self.state_dict_type = values.parse_choice("state_dict_type", self.state_dict_type, StateDictType)
        if self.fsdp_version == 2 and self.state_dict_type is StateDictType.LOCAL_STATE_DICT:
            raise values.error(
                "state_dict_type",
                self.state_dict_type.name,
                "fsdp_version=2 has no local state dict",
                "Use SHARDED_STATE_DICT or FULL_STATE_DICT.",
            )
        model_cls, optim_cls, model_default, optim_default = _STATE_DICT_KINDS[self.state_dict_type]
        if not isinstance(self.state_dict_config, model_cls):
            self.state_dict_config = model_default
        if not isinstance(self.optim_state_dict_config, optim_cls):
            self.optim_state_dict_config = optim_default

    def set_auto_wrap_policy(self, model: nn.Module) -> None:
        """Bind a name-based policy to ``model``: class names become the classes found in ``model``.

        ``transformer_based_wrap`` uses ``transformer_cls_names_to_wrap``, else ``model._no_split_modules``;
        ``size_based_wrap`` uses ``min_num_params`` (0 turns wrapping off). A policy already bound, a
        callable of the user's or ``None`` is left as it is.
        """
        if self.auto_wrap_policy is transformer_auto_wrap_policy:
            classes = _find_block_classes(model, self.transformer_cls_names_to_wrap)
            self.transformer_cls_names_to_wrap = [c.__name__ for c in classes]
            self.auto_wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(classes))
        elif self.auto_wrap_policy is size_based_auto_wrap_policy:
            min_num_params = int(1e8) if self.min_num_params is None else self.min_num_params
            self.auto_wrap_policy = (
                functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
                if min_num_params > 0
                else None
            )

    def set_mixed_precision(
        self, mixed_precision: str | torch.dtype, buffer_autocast: bool = False, override: bool = False
    ) -> None:
        """Set a mixed precision policy computing in ``mixed_precision`` ("fp16", "bf16", "fp32" or a dtype).

        Leaves an existing policy alone unless ``override``; a dict policy is turned into the policy object.
        ``buffer_autocast`` keeps buffers in float32 (version 1).
        """
        dtype = values.parse_dtype("mixed_precision_policy", mixed_precision)
        if override or self.mixed_precision_policy is None:
            if self.fsdp_version == 1:
                buffer_dtype = torch.float32 if buffer_autocast else dtype
                self.mixed_precision_policy = MixedPrecision(dtype, dtype, buffer_dtype)
            else:
                self.mixed_precision_policy = MixedPrecisionPolicy(dtype, dtype, output_dtype=dtype)
        elif isinstance(self.mixed_precision_policy, dict):
            self._parse_mixed_precision_policy()

    def validate_mixed_precision_policy(self) -> None:
        """Raise ``TypeError`` unless the policy is ``None`` or the object this ``fsdp_version`` takes."""
        wanted = MixedPrecision if self.fsdp_version == 1 else MixedPrecisionPolicy
        if self.mixed_precision_policy is not None and not isinstance(self.mixed_precision_policy, wanted):
            raise values.error(
                "mixed_precision_policy",
                self.mixed_precision_policy,
                f"fsdp_version={self.fsdp_version} takes a {wanted.__name__}",
                f'Pass {wanted.__name__}(param_dtype=..., ...), a dict of dtypes or a string such as "bf16".',
                TypeError,
            )

    # --- fullshard additions ----------------------------------------------------------------------------

    def resolve_ignored_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules of ``model`` to leave unsharded (a regex selects them by name, fullmatch)."""
        if self.ignored_modules is None:
            return []
        if isinstance(self.ignored_modules, str):
            pattern = re.compile(self.ignored_modules)
            return [m for name, m in model.named_modules() if name and pattern.fullmatch(name)]
        return list(self.ignored_modules)

    def fsdp_kwargs(self, model: nn.Module | None = None) -> dict[str, Any]:
        """Keyword arguments for ``FullyShardedDataParallel(model, **kwargs)`` (``fsdp_version=1``).

        ``model`` is needed to bind a name-based auto wrap policy and a regex of ignored modules.
        """
        self._require_version(1, "fsdp_kwargs", "fully_shard_kwargs")
        return {
            **self.entry_options(),
            "cpu_offload": self.cpu_offload,
            "auto_wrap_policy": self._bound_policy(model),
            "mixed_precision": self.mixed_precision_policy,
            "ignored_modules": self._ignored_for(model),
            "param_init_fn": self.param_init_fn,
            "sync_module_states": self.sync_module_states,
        }

    def fully_shard_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``fully_shard(module, **kwargs)`` (``fsdp_version=2``)."""
        self._require_version(2, "fully_shard_kwargs", "fsdp_kwargs")
        return {
            **self.entry_options(),
            "mp_policy": self.mixed_precision_policy or MixedPrecisionPolicy(),
            "offload_policy": self.cpu_offload,
        }

    def entry_options(self) -> dict[str, Any]:
        """The options of this version's entry point that are neither units, ignored modules, precision,
        offload nor initialisation: ``reshard_after_forward`` for ``fully_shard``, the strategy, prefetch and
        gather settings for ``FullyShardedDataParallel``; and ``invariant_micro_batches`` for both, when set."""
        invariant = (
            {} if self.invariant_micro_batches is None else {"invariant_micro_batches": self.invariant_micro_batches}
        )
        if self.fsdp_version == 2:
            return {"reshard_after_forward": self.reshard_after_forward, **invariant}
        return {
            "sharding_strategy": self.sharding_strategy,
            "backward_prefetch": self.backward_prefetch,
            "forward_prefetch": self.forward_prefetch,
            "limit_all_gathers": self.limit_all_gathers,
            "use_orig_params": self.use_orig_params,
            **invariant,
        }

    def to_engine_kwargs(self, model: nn.Module | None = None) -> dict[str, Any]:
        """:meth:`fsdp_kwargs` for ``fsdp_version=1``, :meth:`fully_shard_kwargs` for 2."""
        return self.fsdp_kwargs(model) if self.fsdp_version == 1 else self.fully_shard_kwargs()

    def to_env(self) -> dict[str, str]:
        """The ``FSDP_*`` variables that rebuild this plugin's settings in another process.

        Settings that have no text form (a policy callable of the user's, a list of module objects) are left out.
        """
        return env.format_env({name: _env_value(self, name) for name in (v.field for v in env.FSDP_VARS)})

    def _require_version(self, version: int, method: str, other: str) -> None:
        if self.fsdp_version != version:
            raise ValueError(
                f"{_PLUGIN}.{method}() with fsdp_version={self.fsdp_version}: these arguments are for "
                f"fsdp_version={version}. Call {other}() instead, or to_engine_kwargs() for either."
            )

    def _bound_policy(self, model: nn.Module | None) -> Callable[..., Any] | None:
        if self.auto_wrap_policy in (transformer_auto_wrap_policy, size_based_auto_wrap_policy):
            if model is None:
                raise ValueError(
                    f"{_PLUGIN}.fsdp_kwargs(model=None) with a name-based auto_wrap_policy: the class names "
                    "must be looked up in the model. Pass the model, or call set_auto_wrap_policy(model) first."
                )
            self.set_auto_wrap_policy(model)
        return self.auto_wrap_policy  # type: ignore[return-value]

    def _ignored_for(self, model: nn.Module | None) -> list[nn.Module] | None:
        if self.ignored_modules is None:
            return None
        if isinstance(self.ignored_modules, str) and model is None:
            raise ValueError(
                f"{_PLUGIN}.fsdp_kwargs(model=None) with ignored_modules={self.ignored_modules!r}: the regex "
                "selects modules by name, so the model is needed. Pass the model."
            )
        return self.resolve_ignored_modules(model) if model is not None else list(self.ignored_modules)

    def _parse_mixed_precision_policy(self) -> None:
        policy = self.mixed_precision_policy
        if isinstance(policy, (str, torch.dtype)):
            self.set_mixed_precision(policy, override=True)
        elif isinstance(policy, dict):
            self.mixed_precision_policy = values.policy_from_dict(policy, self.fsdp_version)
        else:
            self.mixed_precision_policy = values.coerce_config(
                "mixed_precision_policy", policy, (MixedPrecision, MixedPrecisionPolicy)
            )


# --- applying the values to the plugin ----------------------------------------------------


def _resolve_sharding(plugin: FullyShardedDataParallelPlugin, from_env: dict[str, Any]) -> None:
    """Set ``sharding_strategy`` and ``reshard_after_forward`` from the arguments, else the environment.

    Explicit arguments must agree with each other; the environment is read by :func:`_env_strategies`.
    """
    given = {
        name: values.to_strategy(name, getattr(plugin, name))
        for name in ("sharding_strategy", "reshard_after_forward")
        if getattr(plugin, name) is not None
    }
    if len(set(given.values())) > 1:
        raise values.error(
            "sharding_strategy",
            plugin.sharding_strategy,
            f"contradicts reshard_after_forward={plugin.reshard_after_forward!r}",
            "Pass only one of them (reshard_after_forward is the newer name).",
        )
    candidates = [*given.values(), *_env_strategies(from_env, plugin.fsdp_version), ShardingStrategy.FULL_SHARD]
    strategy = candidates[0]
    if plugin.fsdp_version == 2 and strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        raise values.error(
            "sharding_strategy",
            strategy.name,
            "fsdp_version=2 shards with reshard_after_forward=True (FULL_SHARD) or False (SHARD_GRAD_OP) only",
            "Use one of those, or fsdp_version=1 for NO_SHARD and hybrid strategies.",
        )
    if plugin.fsdp_version == 1:
        plugin.sharding_strategy = plugin.reshard_after_forward = strategy
        return
    # Version 2 as Accelerate reads it: reshard_after_forward says it all, sharding_strategy is None.
    plugin.reshard_after_forward = strategy is ShardingStrategy.FULL_SHARD
    if "sharding_strategy" in given and "reshard_after_forward" not in given:
        warnings.warn(
            f"{_PLUGIN}(fsdp_version=2, sharding_strategy={plugin.sharding_strategy!r}): fsdp_version=2 has no "
            f"sharding strategy; using reshard_after_forward={plugin.reshard_after_forward}. Pass "
            "reshard_after_forward=True (FULL_SHARD) or False (SHARD_GRAD_OP) instead.",
            stacklevel=4,
        )
    plugin.sharding_strategy = None


def _env_strategies(from_env: dict[str, Any], version: int) -> list[ShardingStrategy]:
    """The strategies the environment names, most specific first.

    ``accelerate launch`` always writes both variables, filling the one the config lacks with its flag's
    default (FSDP_SHARDING_STRATEGY=FULL_SHARD, FSDP_RESHARD_AFTER_FORWARD=true). So FSDP_RESHARD_AFTER_FORWARD
    comes first, except that a bool there yields to FSDP_SHARDING_STRATEGY for ``fsdp_version=1`` (whose configs
    put a strategy name in ``fsdp_reshard_after_forward``, so a bool is the default).
    """
    raf, strategy = from_env.get("reshard_after_forward"), from_env.get("sharding_strategy")
    ordered = [strategy, raf] if version == 1 and isinstance(raf, bool) else [raf, strategy]
    return [values.to_strategy("sharding_strategy", v) for v in ordered if v is not None]


def _parse_bool_field(plugin: FullyShardedDataParallelPlugin, name: str, default: bool) -> None:
    value = getattr(plugin, name)
    if value is None:
        setattr(plugin, name, default)
    elif env.is_bool_text(value):
        setattr(plugin, name, env.parse_bool(value))
    else:
        raise values.error(name, value, "not a bool", "Pass True or False.", TypeError)


def _parse_fields(plugin: FullyShardedDataParallelPlugin) -> None:
    """Turn every remaining field into its typed value (see the module docstring)."""
    backward_prefetch = plugin.backward_prefetch
    if backward_prefetch is not None:
        plugin.backward_prefetch = values.parse_choice("backward_prefetch", backward_prefetch, BackwardPrefetch)
    if plugin.fsdp_version == 2 and plugin.backward_prefetch is not None:
        warnings.warn(
            f"{_PLUGIN}(fsdp_version=2, backward_prefetch={plugin.backward_prefetch.name}): fully_shard prefetches "
            "the next unit in backward on its own, so backward_prefetch is set to None (as Accelerate does). Leave "
            "it unset for fsdp_version=2.",
            stacklevel=4,
        )
        plugin.backward_prefetch = None
    plugin.auto_wrap_policy = values.parse_auto_wrap_policy(plugin.auto_wrap_policy)
    plugin.cpu_offload = values.parse_cpu_offload(plugin.cpu_offload, plugin.fsdp_version)
    plugin.ignored_modules = values.parse_ignored_modules(plugin.ignored_modules)
    plugin.transformer_cls_names_to_wrap = values.parse_names(plugin.transformer_cls_names_to_wrap)
    plugin.min_num_params = values.parse_min_num_params(plugin.min_num_params)
    for name in _BOOL_FIELDS:
        _parse_bool_field(plugin, name, default=name in ("limit_all_gathers", "whole_param_step"))
    if plugin.param_init_fn is not None and not callable(plugin.param_init_fn):
        raise values.error(
            "param_init_fn", plugin.param_init_fn, "not callable", "Pass a function (module) -> None.", TypeError
        )


def _resolve_invariant(value: Any, given: bool) -> int | None:
    """``G`` of world-size-invariant mode, or ``None`` (off): the argument, else ``FSDP_INVARIANT_MICRO_BATCHES``
    (already read into ``value``), else the engine's ``FULLSHARD_INVARIANT_MICRO_BATCHES``. Refused: a ``G`` that
    is not a power of two, and the two variables (or an explicit 0 and the engine's variable) disagreeing."""
    var = env.by_field("invariant_micro_batches")
    if value is None:
        return resolve_invariant_micro_batches(None, _PLUGIN)  # FULLSHARD_INVARIANT_MICRO_BATCHES, or None
    name = f"{_PLUGIN}.invariant_micro_batches" if given else f"environment variable {var.env}"
    count = var.parse(value, where=name)
    source = f"{name}={value!r}"
    engine_env = os.environ.get(INVARIANT_ENV, "").strip()
    if engine_env not in ("", "0", str(count)) and (count == 0 or not given):
        raise ValueError(
            f"{source} and {INVARIANT_ENV}={engine_env!r} disagree on world-size-invariant mode (the engine reads "
            f"{INVARIANT_ENV} wherever no G is passed). Set only one of them."
        )
    if count & (count - 1):
        raise ValueError(
            f"{source}: world-size-invariant mode needs the number G of micro-batches per step to be a power of two "
            "(1, 2, 4, 8, ...), a multiple of every world size the run will use; 0 or None turns it off."
        )
    return count or None


def _check_state_dict_configs(plugin: FullyShardedDataParallelPlugin, type_given: bool) -> None:
    """Convert torch's state dict configs to ours and check they agree with ``state_dict_type``.

    A config passed without ``state_dict_type`` sets the type (it overrides FSDP_STATE_DICT_TYPE, as explicit
    arguments do); a config of another kind than an explicit ``state_dict_type`` is an error.
    """
    configs_given = plugin.state_dict_config is not None or plugin.optim_state_dict_config is not None
    if configs_given and not type_given:
        plugin.state_dict_type = None
    kind = (
        None
        if plugin.state_dict_type is None
        else values.parse_choice("state_dict_type", plugin.state_dict_type, StateDictType)
    )
    for field, index in (("state_dict_config", 0), ("optim_state_dict_config", 1)):
        value = getattr(plugin, field)
        if value is None:
            continue
        value = values.coerce_config(field, value, tuple(k[index] for k in _STATE_DICT_KINDS.values()))
        setattr(plugin, field, value)
        matching = [t for t, k in _STATE_DICT_KINDS.items() if isinstance(value, k[index])]
        if kind is None:
            plugin.state_dict_type = kind = matching[0]
        elif kind not in matching:
            raise values.error(
                field,
                value,
                f"does not match state_dict_type={kind.name}",
                f"Pass a {_STATE_DICT_KINDS[kind][index].__name__}, or leave it None to use the default.",
            )


def _apply_cpu_ram_efficient_loading(plugin: FullyShardedDataParallelPlugin, given: set[str]) -> None:
    """``cpu_ram_efficient_loading`` forces ``sync_module_states`` and is exported for ``transformers``."""
    if "cpu_ram_efficient_loading" in given:
        env.write_field("cpu_ram_efficient_loading", plugin.cpu_ram_efficient_loading)
    if plugin.cpu_ram_efficient_loading and not plugin.sync_module_states:
        if "sync_module_states" in given:
            warnings.warn(
                f"{_PLUGIN}(sync_module_states=False, cpu_ram_efficient_loading=True): only rank 0 loads the "
                "weights, so the others need them broadcast; setting sync_module_states=True.",
                stacklevel=4,
            )
        plugin.sync_module_states = True


def _find_block_classes(model: nn.Module, names: list[str] | None) -> list[type[nn.Module]]:
    """The classes of ``model``'s modules named ``names`` (default: ``model._no_split_modules``)."""
    names = names if names is not None else list(getattr(model, "_no_split_modules", None) or [])
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    blocks = ", ".join(_block_class_names(model)) or "(none)"
    if not names:
        raise ValueError(
            f"{_PLUGIN}.set_auto_wrap_policy({type(model).__name__}) with auto_wrap_policy=TRANSFORMER_BASED_WRAP: "
            "no transformer_cls_names_to_wrap and the model has no _no_split_modules. "
            f"Pass transformer_cls_names_to_wrap=[...]; the model's block classes are: {blocks}."
        )
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(
            f"{_PLUGIN}.transformer_cls_names_to_wrap={names!r}: transformer layer class {missing[0]} not found "
            f"in {type(model).__name__}. The model's block classes are: {blocks}."
        )
    return [by_name[n] for n in names]


def _block_class_names(model: nn.Module) -> list[str]:
    """Names of the classes of ``model``'s submodules that have children (containers left out)."""
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    names = [
        type(m).__name__
        for m in model.modules()
        if m is not model and next(m.children(), None) is not None and not isinstance(m, containers)
    ]
    return list(dict.fromkeys(names))


def _env_value(plugin: FullyShardedDataParallelPlugin, name: str) -> Any:
    """The value of field ``name`` in the form the env table writes, or ``None`` when it has none."""
    value = getattr(plugin, name)
    if name == "auto_wrap_policy":
        func = getattr(value, "func", value)
        names = {transformer_auto_wrap_policy: "TRANSFORMER_BASED_WRAP", size_based_auto_wrap_policy: "SIZE_BASED_WRAP"}
        return "NO_WRAP" if value is None else names.get(func)
    if name == "cpu_offload":
        return isinstance(value, CPUOffloadPolicy) or getattr(value, "offload_params", False)
    if name == "backward_prefetch" and value is None:
        return "NO_PREFETCH"
    if name == "ignored_modules":
        return value if isinstance(value, str) else None
    return value


def get_module_class_from_name(module: nn.Module, name: str) -> type[nn.Module] | None:
    """The class named ``name`` of ``module`` or of the first module below it (depth first) that has it, else
    ``None``: Accelerate's lookup, which PEFT's ``fsdp_auto_wrap_policy`` imports."""
    if type(module).__name__ == name:
        return type(module)
    for child in module.children():
        found = get_module_class_from_name(child, name)
        if found is not None:
            return found
    return None

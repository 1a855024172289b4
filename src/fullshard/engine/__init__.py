"""The sharding engine: imports torch only, knows nothing of the front end.

Layout rule: one module per noun (docs/design.md); a new module imports only engine modules and torch. This
``__init__`` is the engine's surface: every other package (algorithms/, checkpoint/, frontend/, cli/, testing/,
utils/, accelerate/ and the top-level modules) imports engine names from ``fullshard.engine`` alone, never from a
submodule (``tests/unit/test_import_layers.py``); a name another package needs goes into ``__all__`` here. Engine
modules import each other by submodule, never from this surface, so importing any of them first has no circle.

The names are imported on first use (PEP 562 ``__getattr__``; the table is the ``if TYPE_CHECKING:`` imports): a
package that needs only ``api``'s enums (``frontend/env.py``, so ``fullshard launch``) does not import DTensor.
"""

from typing import TYPE_CHECKING

from fullshard.surface import lazy_surface

if TYPE_CHECKING:  # the table of what is imported from where, read by lazy_surface: imported on first use
    from fullshard.engine.api import (
        BackwardPrefetch,
        CPUOffload,
        CPUOffloadPolicy,
        FullOptimStateDictConfig,
        FullStateDictConfig,
        LocalOptimStateDictConfig,
        LocalStateDictConfig,
        MixedPrecision,
        MixedPrecisionPolicy,
        Offload,
        OffloadPolicy,
        OptimStateDictConfig,
        OptimStateKeyType,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        ShardingStrategy,
        StateDictConfig,
        StateDictSettings,
        StateDictType,
    )
    from fullshard.engine.coerce import coerce_enum
    from fullshard.engine.collectives import all_reduce_flat, predivide_factor, reduce_scatter_flat
    from fullshard.engine.cpu_memory import allocator_set_by_user, keep_freed_memory
    from fullshard.engine.fully_shard import (
        FSDPModule,
        UnshardHandle,
        fully_shard,
        register_fsdp_forward_method,
        share_comm_ctx,
    )
    from fullshard.engine.grad_norm import clip_grad_norm_, clip_module_grad_norm_
    from fullshard.engine.invariant import ENV as INVARIANT_ENV
    from fullshard.engine.invariant import (
        invariant_micro_batches,
        invariant_per_rank,
        micro_batches_per_rank,
        pending_micro_batches,
        restore_step_in_progress,
        step_in_progress,
    )
    from fullshard.engine.invariant import resolve as resolve_invariant_micro_batches
    from fullshard.engine.layout import ShardLayout
    from fullshard.engine.local_step import exclude as keep_dtensor_step
    from fullshard.engine.names import clean_key
    from fullshard.engine.optim_state import (
        WHOLE_STATES_KEY,
        StateSpec,
        model_params,
        optim_state_dict,
        optim_state_dict_to_load,
        scatter_full_optim_state_dict,
        scatter_states,
    )
    from fullshard.engine.param import add_step_check, local_tensor, owner_label, replacement_for, retired_data_ptr
    from fullshard.engine.state_dict import expected_entries, extension_params, mismatches, state_dict_type
    from fullshard.engine.summon import summon_full_params
    from fullshard.engine.unit import InitOptions
    from fullshard.engine.unit_state import gradient_sync, has_units, is_unit
    from fullshard.engine.wrap import (
        CustomPolicy,
        ModuleWrapPolicy,
        UnitPlan,
        always_wrap_policy,
        enable_wrap,
        lambda_auto_wrap_policy,
        plan_units,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
        wrap,
    )
    from fullshard.engine.wrapper import (
        FSDP,
        FULL_PRECISION_OUTPUT,
        FullyShardedDataParallel,
        plan_wrapper_units,
        wrap_units,
    )

__all__ = [
    # the two entry points (wrapper.py, fully_shard.py) and auto-wrap (wrap.py)
    "FSDP",
    "FSDPModule",
    "FullyShardedDataParallel",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
    # public enums and configuration (api.py), and the coercion every enum argument goes through
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
    "coerce_enum",
    # planning units once, applied through the entry points (algorithms/plan.py)
    "FULL_PRECISION_OUTPUT",
    "InitOptions",
    "UnitPlan",
    "plan_units",
    "plan_wrapper_units",
    "wrap_units",
    # a sharded model's units and parameters
    "ShardLayout",
    "clean_key",
    "gradient_sync",
    "has_units",
    "is_unit",
    "local_tensor",
    "owner_label",
    "replacement_for",
    "retired_data_ptr",
    # state dicts, full parameters, gradients
    "StateSpec",
    "WHOLE_STATES_KEY",
    "add_step_check",
    "keep_dtensor_step",
    "clip_grad_norm_",
    "clip_module_grad_norm_",
    "expected_entries",
    "extension_params",
    "mismatches",
    "model_params",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "scatter_full_optim_state_dict",
    "scatter_states",
    "state_dict_type",
    "summon_full_params",
    # world-size-invariant mode's G, as the entry points read it (invariant.py; the front end's plugin)
    "INVARIANT_ENV",
    "resolve_invariant_micro_batches",
    # a model sharded in invariant mode, as plain values: G, G/N (computed here only), the step in progress
    # (micro-batches folded, their partial sums: the front end's save_state / load_state)
    "invariant_micro_batches",
    "invariant_per_rank",
    "micro_batches_per_rank",
    "pending_micro_batches",
    "step_in_progress",
    "restore_step_in_progress",
    # the collectives a communication hook calls (algorithms/comm_hooks.py)
    "all_reduce_flat",
    "predivide_factor",
    "reduce_scatter_flat",
    # the C allocator's setting on CPU (testing/bench.py gives every benchmarked system the same)
    "allocator_set_by_user",
    "keep_freed_memory",
]

__getattr__, __dir__ = lazy_surface(__name__, __file__)

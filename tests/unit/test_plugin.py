"""FullyShardedDataParallelPlugin: seed 003's defaults, the environment, validation messages, wrap policies."""

from __future__ import annotations

import functools
import re
import warnings

import pytest
import torch
from torch import nn

import fullshard.engine.api as api
from fullshard.engine.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
from fullshard.frontend import env
from fullshard.frontend.plugin import FullyShardedDataParallelPlugin as Plugin

P = "FullyShardedDataParallelPlugin"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*env.FSDP_VARS, *env.LAUNCH_VARS):
        # Recorded first, so that undoing also removes what the plugin writes itself (cpu_ram_efficient_loading
        # exports FSDP_CPU_RAM_EFFICIENT_LOADING): later tests, and worker pools spawned later, start clean.
        monkeypatch.setenv(var.env, "")
        monkeypatch.delenv(var.env)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


class TinyModel(nn.Module):
    _no_split_modules = ("Block",)

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 10)


# --- defaults (seed 003) ----------------------------------------------------------------------------------


def test_defaults_version_1() -> None:
    plugin = Plugin()
    assert plugin.fsdp_version == 1
    assert plugin.sharding_strategy is api.ShardingStrategy.FULL_SHARD
    assert plugin.reshard_after_forward is api.ShardingStrategy.FULL_SHARD
    assert plugin.backward_prefetch is None  # NO_PREFETCH
    assert plugin.mixed_precision_policy is None
    assert plugin.auto_wrap_policy is None  # NO_WRAP
    assert plugin.cpu_offload == api.CPUOffload(offload_params=False)
    assert plugin.ignored_modules is None
    assert plugin.state_dict_type is api.StateDictType.FULL_STATE_DICT
    assert plugin.state_dict_config == api.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    assert plugin.optim_state_dict_config == api.FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    assert plugin.limit_all_gathers is True
    assert plugin.use_orig_params is False
    assert plugin.param_init_fn is None
    assert plugin.sync_module_states is False
    assert plugin.forward_prefetch is False
    assert plugin.activation_checkpointing is False
    assert plugin.cpu_ram_efficient_loading is False
    assert plugin.transformer_cls_names_to_wrap is None
    assert plugin.min_num_params is None


def test_defaults_version_2() -> None:
    plugin = Plugin(fsdp_version=2)
    assert plugin.reshard_after_forward is True
    assert plugin.sharding_strategy is None  # as Accelerate's: version 2 has reshard_after_forward only
    assert plugin.cpu_offload == api.OffloadPolicy()
    assert plugin.state_dict_type is api.StateDictType.SHARDED_STATE_DICT
    assert plugin.state_dict_config == api.ShardedStateDictConfig(offload_to_cpu=True)
    assert plugin.optim_state_dict_config == api.ShardedOptimStateDictConfig(offload_to_cpu=True)


# --- the environment ------------------------------------------------------------------------------------


def test_fields_are_filled_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP")
    monkeypatch.setenv("FSDP_MIN_NUM_PARAMS", "2000")
    plugin = Plugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is False
    assert plugin.sharding_strategy is None
    assert plugin.cpu_offload == api.CPUOffloadPolicy()
    assert plugin.auto_wrap_policy is size_based_auto_wrap_policy
    assert plugin.min_num_params == 2000


def test_explicit_arguments_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")
    plugin = Plugin(fsdp_version=1, sharding_strategy="NO_SHARD", cpu_offload=False, state_dict_type="FULL_STATE_DICT")
    assert plugin.fsdp_version == 1
    assert plugin.sharding_strategy is api.ShardingStrategy.NO_SHARD
    assert plugin.cpu_offload == api.CPUOffload(offload_params=False)
    assert plugin.state_dict_type is api.StateDictType.FULL_STATE_DICT


def test_explicit_state_dict_config_sets_the_type_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seed 001's example: full configs passed explicitly, the launched config says SHARDED_STATE_DICT.
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")
    plugin = Plugin(
        state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
    )
    assert plugin.state_dict_type is api.StateDictType.FULL_STATE_DICT
    assert plugin.state_dict_config == api.FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    assert plugin.optim_state_dict_config == api.FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)


# --- strings, numbers and foreign enums -------------------------------------------------------------------


@pytest.mark.parametrize("value", ["shard_grad_op", 2, "2", api.ShardingStrategy.SHARD_GRAD_OP, False])
def test_sharding_strategy_spellings(value: object) -> None:
    assert Plugin(sharding_strategy=value).sharding_strategy is api.ShardingStrategy.SHARD_GRAD_OP


def test_torch_enums_and_configs_are_accepted() -> None:
    from torch.distributed import fsdp

    plugin = Plugin(
        sharding_strategy=fsdp.ShardingStrategy._HYBRID_SHARD_ZERO2,
        backward_prefetch=fsdp.BackwardPrefetch.BACKWARD_POST,
        cpu_offload=fsdp.CPUOffload(offload_params=True),
        mixed_precision_policy=fsdp.MixedPrecision(param_dtype=torch.bfloat16),
        state_dict_type=fsdp.StateDictType.SHARDED_STATE_DICT,
    )
    assert plugin.sharding_strategy is api.ShardingStrategy._HYBRID_SHARD_ZERO2
    assert plugin.backward_prefetch is api.BackwardPrefetch.BACKWARD_POST
    assert plugin.cpu_offload == api.CPUOffload(offload_params=True)
    assert plugin.mixed_precision_policy == api.MixedPrecision(param_dtype=torch.bfloat16)
    assert plugin.state_dict_type is api.StateDictType.SHARDED_STATE_DICT


def test_reshard_after_forward_in_version_1_is_a_strategy() -> None:
    assert Plugin(reshard_after_forward=False).sharding_strategy is api.ShardingStrategy.SHARD_GRAD_OP
    with pytest.warns(UserWarning, match="using reshard_after_forward=False"):
        plugin = Plugin(fsdp_version=2, sharding_strategy="SHARD_GRAD_OP")
    assert plugin.reshard_after_forward is False and plugin.sharding_strategy is None


def test_cpu_offload_follows_the_version() -> None:
    assert Plugin(fsdp_version=2, cpu_offload=api.CPUOffload(offload_params=True)).cpu_offload == api.CPUOffloadPolicy()
    assert Plugin(cpu_offload=api.CPUOffloadPolicy()).cpu_offload == api.CPUOffload(offload_params=True)


# --- mixed precision --------------------------------------------------------------------------------------


def test_mixed_precision_string_and_dict() -> None:
    bf16 = torch.bfloat16
    assert Plugin(mixed_precision_policy="bf16").mixed_precision_policy == api.MixedPrecision(bf16, bf16, bf16)
    assert Plugin(fsdp_version=2, mixed_precision_policy="bf16").mixed_precision_policy == api.MixedPrecisionPolicy(
        bf16, bf16, output_dtype=bf16
    )
    policy = Plugin(
        mixed_precision_policy={"param_dtype": "fp16", "reduce_dtype": torch.float32}
    ).mixed_precision_policy
    assert policy == api.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)


def test_set_mixed_precision_keeps_a_policy_unless_override() -> None:
    plugin = Plugin(mixed_precision_policy="fp16")
    plugin.set_mixed_precision("bf16")
    assert plugin.mixed_precision_policy.param_dtype is torch.float16
    plugin.set_mixed_precision("bf16", buffer_autocast=True, override=True)
    assert plugin.mixed_precision_policy == api.MixedPrecision(torch.bfloat16, torch.bfloat16, torch.float32)


# --- state dict -------------------------------------------------------------------------------------------


def test_set_state_dict_type_replaces_configs_of_another_kind() -> None:
    plugin = Plugin(state_dict_type="SHARDED_STATE_DICT")
    plugin.set_state_dict_type("FULL_STATE_DICT")
    assert plugin.state_dict_type is api.StateDictType.FULL_STATE_DICT
    assert plugin.state_dict_config == api.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    assert plugin.optim_state_dict_config == api.FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)


# --- cpu_ram_efficient_loading ----------------------------------------------------------------------------


def test_cpu_ram_efficient_loading_forces_sync_and_exports_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(UserWarning, match=re.escape("setting sync_module_states=True")):
        plugin = Plugin(cpu_ram_efficient_loading=True, sync_module_states=False)
    assert plugin.sync_module_states is True
    assert env.read_env()["cpu_ram_efficient_loading"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Plugin(cpu_ram_efficient_loading=True).sync_module_states is True


# --- auto wrap --------------------------------------------------------------------------------------------


def test_transformer_wrap_finds_the_named_classes() -> None:
    plugin = Plugin(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap="Block")
    plugin.set_auto_wrap_policy(TinyModel())
    assert isinstance(plugin.auto_wrap_policy, functools.partial)
    assert plugin.auto_wrap_policy.func is transformer_auto_wrap_policy
    assert plugin.auto_wrap_policy.keywords == {"transformer_layer_cls": {Block}}
    block = Block()
    assert plugin.auto_wrap_policy(block, False, 0) is True
    assert plugin.auto_wrap_policy(block.attn, False, 0) is False


def test_transformer_wrap_falls_back_to_no_split_modules() -> None:
    plugin = Plugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    plugin.set_auto_wrap_policy(TinyModel())
    assert plugin.auto_wrap_policy.keywords == {"transformer_layer_cls": {Block}}
    assert plugin.transformer_cls_names_to_wrap == ["Block"]


def test_size_based_wrap() -> None:
    plugin = Plugin(auto_wrap_policy="size_based_wrap", min_num_params=50)
    plugin.set_auto_wrap_policy(TinyModel())
    assert plugin.auto_wrap_policy.func is size_based_auto_wrap_policy
    assert plugin.auto_wrap_policy.keywords == {"min_num_params": 50}
    off = Plugin(auto_wrap_policy="size_based_wrap", min_num_params=0)
    off.set_auto_wrap_policy(TinyModel())
    assert off.auto_wrap_policy is None


def test_ignored_modules_regex() -> None:
    model = TinyModel()
    plugin = Plugin(ignored_modules=r"layers\.\d")
    assert plugin.resolve_ignored_modules(model) == [model.layers[0], model.layers[1]]
    assert plugin.fsdp_kwargs(model)["ignored_modules"] == [model.layers[0], model.layers[1]]


# --- engine keyword arguments -----------------------------------------------------------------------------


def test_fsdp_kwargs_use_the_constructor_names() -> None:
    plugin = Plugin(auto_wrap_policy="transformer_based_wrap", backward_prefetch="BACKWARD_PRE")
    kwargs = plugin.fsdp_kwargs(TinyModel())
    assert set(kwargs) == {
        "sharding_strategy", "cpu_offload", "auto_wrap_policy", "backward_prefetch", "mixed_precision",
        "ignored_modules", "param_init_fn", "sync_module_states", "forward_prefetch", "limit_all_gathers",
        "use_orig_params",
    }  # fmt: skip
    assert kwargs["auto_wrap_policy"].keywords == {"transformer_layer_cls": {Block}}
    assert kwargs["backward_prefetch"] is api.BackwardPrefetch.BACKWARD_PRE
    assert plugin.to_engine_kwargs(TinyModel()).keys() == kwargs.keys()


def test_fully_shard_kwargs() -> None:
    kwargs = Plugin(fsdp_version=2, reshard_after_forward=False, cpu_offload=True).fully_shard_kwargs()
    assert kwargs == {
        "reshard_after_forward": False,
        "mp_policy": api.MixedPrecisionPolicy(),
        "offload_policy": api.CPUOffloadPolicy(),
    }


# --- every validation message -----------------------------------------------------------------------------

BAD_ARGUMENTS = [
    (dict(fsdp_version=3), ValueError, f"{P}.fsdp_version=3: FSDP version must be 1 or 2."),
    (
        dict(sharding_strategy="ZERO3"),
        ValueError,
        f"{P}.sharding_strategy='ZERO3': not a valid choice. Use one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
        "HYBRID_SHARD, HYBRID_SHARD_ZERO2.",
    ),
    (
        dict(sharding_strategy="FULL_SHARD", reshard_after_forward=False),
        ValueError,
        f"{P}.sharding_strategy='FULL_SHARD': contradicts reshard_after_forward=False. Pass only one of them",
    ),
    (
        dict(fsdp_version=2, sharding_strategy="NO_SHARD"),
        ValueError,
        f"{P}.sharding_strategy='NO_SHARD': fsdp_version=2 shards with reshard_after_forward=True (FULL_SHARD) "
        "or False (SHARD_GRAD_OP) only. Use one of those, or fsdp_version=1",
    ),
    (
        dict(reshard_after_forward="sometimes"),
        ValueError,
        f"{P}.reshard_after_forward='sometimes': expected true/false (fsdp_version 2) or a sharding strategy",
    ),
    (
        dict(backward_prefetch="SOON"),
        ValueError,
        f"{P}.backward_prefetch='SOON': not a valid choice. Use one of BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH.",
    ),
    (
        dict(auto_wrap_policy="everything"),
        ValueError,
        f"{P}.auto_wrap_policy='everything': not a valid choice. Use one of TRANSFORMER_BASED_WRAP, "
        "SIZE_BASED_WRAP, NO_WRAP.",
    ),
    (dict(auto_wrap_policy=5), TypeError, f'{P}.auto_wrap_policy=5: not a policy. Pass "transformer_based_wrap"'),
    (
        dict(cpu_offload="later"),
        TypeError,
        f"{P}.cpu_offload='later': not a CPUOffload or CPUOffloadPolicy or OffloadPolicy. Pass a fullshard",
    ),
    (dict(ignored_modules="(("), ValueError, f"{P}.ignored_modules='((': not a valid regular expression"),
    (dict(ignored_modules=[1]), TypeError, f"{P}.ignored_modules=[1]: not modules. Pass an iterable of nn.Module"),
    (
        dict(state_dict_type="SHARDED"),
        ValueError,
        f"{P}.state_dict_type='SHARDED': not a valid choice. Use one of FULL_STATE_DICT, LOCAL_STATE_DICT, "
        "SHARDED_STATE_DICT.",
    ),
    (
        dict(fsdp_version=2, state_dict_type="LOCAL_STATE_DICT"),
        ValueError,
        f"{P}.state_dict_type='LOCAL_STATE_DICT': fsdp_version=2 has no local state dict. Use SHARDED_STATE_DICT",
    ),
    (
        dict(state_dict_type="FULL_STATE_DICT", state_dict_config=api.ShardedStateDictConfig()),
        ValueError,
        f"{P}.state_dict_config=ShardedStateDictConfig(offload_to_cpu=False, _use_dtensor=False): does not match "
        "state_dict_type=FULL_STATE_DICT. Pass a FullStateDictConfig, or leave it None",
    ),
    (dict(use_orig_params="sometimes"), TypeError, f"{P}.use_orig_params='sometimes': not a bool. Pass True or False."),
    (
        dict(mixed_precision_policy="fp8"),
        ValueError,
        f"{P}.mixed_precision_policy='fp8': not a mixed precision. Use one of fp16, bf16, fp32 or the torch dtype.",
    ),
    (
        dict(mixed_precision_policy={"param_dtype": torch.bfloat16, "output_dtype": torch.float32}),
        ValueError,
        "unknown keys ['output_dtype'] for fsdp_version=1. Use keys among param_dtype, reduce_dtype, buffer_dtype",
    ),
    (
        dict(mixed_precision_policy={"param_dtype": "int8"}),
        ValueError,
        f"{P}.mixed_precision_policy['param_dtype']='int8': not a mixed precision.",
    ),
    (
        dict(fsdp_version=2, mixed_precision_policy=api.MixedPrecision(param_dtype=torch.bfloat16)),
        TypeError,
        "fsdp_version=2 takes a MixedPrecisionPolicy. Pass MixedPrecisionPolicy(param_dtype=..., ...)",
    ),
    (dict(min_num_params=-1), ValueError, f"{P}.min_num_params=-1: negative. Pass 0 (no wrapping)"),
    (dict(min_num_params="many"), ValueError, f"{P}.min_num_params='many': not an integer."),
    (dict(transformer_cls_names_to_wrap=5), ValueError, f"{P}.transformer_cls_names_to_wrap=5: expected class names"),
    (dict(param_init_fn=3), TypeError, f"{P}.param_init_fn=3: not callable. Pass a function (module) -> None."),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_ARGUMENTS, ids=lambda x: str(x)[:40])
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        Plugin(**kwargs)


def test_transformer_class_not_found_lists_the_block_classes() -> None:
    plugin = Plugin(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["BertLayer"])
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{P}.transformer_cls_names_to_wrap=['BertLayer']: transformer layer class BertLayer not found in "
            "TinyModel. The model's block classes are: Block."
        ),
    ):
        plugin.set_auto_wrap_policy(TinyModel())


def test_transformer_wrap_without_names_or_no_split_modules() -> None:
    model = nn.Sequential(Block(), Block())
    with pytest.raises(ValueError, match=re.escape("Pass transformer_cls_names_to_wrap=[...]; the model's block")):
        Plugin(auto_wrap_policy="transformer_based_wrap").set_auto_wrap_policy(model)


def test_engine_kwargs_of_the_other_version() -> None:
    with pytest.raises(ValueError, match=re.escape(f"{P}.fsdp_kwargs() with fsdp_version=2: these arguments are for")):
        Plugin(fsdp_version=2).fsdp_kwargs()
    with pytest.raises(ValueError, match=re.escape("Call fsdp_kwargs() instead")):
        Plugin().fully_shard_kwargs()


def test_engine_kwargs_need_the_model_for_names() -> None:
    with pytest.raises(ValueError, match=re.escape("Pass the model, or call set_auto_wrap_policy(model) first.")):
        Plugin(auto_wrap_policy="transformer_based_wrap").fsdp_kwargs()
    with pytest.raises(ValueError, match=re.escape("ignored_modules='head': the regex selects modules by name")):
        Plugin(ignored_modules="head").fsdp_kwargs()

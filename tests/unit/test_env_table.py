"""The FSDP_* table: Accelerate's names, parsing, and plugin → environment → plugin round trips."""

from __future__ import annotations

import re

import pytest

from fullshard.frontend import env
from fullshard.frontend.plugin import FullyShardedDataParallelPlugin

# The variables `accelerate launch` 1.15 writes (accelerate/utils/launch.py) that the plugin reads.
ACCELERATE_FSDP_VARS = {
    "fsdp_version": "FSDP_VERSION",
    "sharding_strategy": "FSDP_SHARDING_STRATEGY",
    "reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "cpu_offload": "FSDP_OFFLOAD_PARAMS",
    "min_num_params": "FSDP_MIN_NUM_PARAMS",
    "auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "transformer_cls_names_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "backward_prefetch": "FSDP_BACKWARD_PREFETCH",
    "state_dict_type": "FSDP_STATE_DICT_TYPE",
    "forward_prefetch": "FSDP_FORWARD_PREFETCH",
    "use_orig_params": "FSDP_USE_ORIG_PARAMS",
    "cpu_ram_efficient_loading": "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "sync_module_states": "FSDP_SYNC_MODULE_STATES",
    "activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
    "ignored_modules": "FSDP_IGNORED_MODULES",
}
# fullshard's own settings in the same family (Accelerate has no such field).
FULLSHARD_FSDP_VARS = {
    "invariant_micro_batches": "FSDP_INVARIANT_MICRO_BATCHES",
    "whole_param_step": "FSDP_WHOLE_PARAM_STEP",
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*env.FSDP_VARS, *env.LAUNCH_VARS):
        # Recorded first, so that undoing also removes what the plugin writes itself (cpu_ram_efficient_loading
        # exports FSDP_CPU_RAM_EFFICIENT_LOADING): later tests, and worker pools spawned later, start clean.
        monkeypatch.setenv(var.env, "")
        monkeypatch.delenv(var.env)


def test_table_uses_accelerates_names() -> None:
    assert {v.field: v.env for v in env.FSDP_VARS} == ACCELERATE_FSDP_VARS | FULLSHARD_FSDP_VARS
    assert {v.field: v.env for v in env.LAUNCH_VARS} == {
        "use_fsdp": "ACCELERATE_USE_FSDP",
        "mixed_precision": "ACCELERATE_MIXED_PRECISION",
        "use_cpu": "ACCELERATE_USE_CPU",
        "debug": "ACCELERATE_DEBUG_MODE",
    }


def test_config_keys_and_flags_are_accelerates() -> None:
    assert env.by_field("transformer_cls_names_to_wrap").config_key == "fsdp_transformer_layer_cls_to_wrap"
    assert env.by_field("cpu_offload").flag == "--fsdp_offload_params"
    assert all(v.config_key.startswith("fsdp_") for v in env.FSDP_VARS)
    # The old key of seed 001's YAML, and keys without the prefix (Accelerate adds it), find their entry.
    assert env.by_config_key("fsdp_backward_prefetch_policy") is env.by_field("backward_prefetch")
    assert env.by_config_key("sharding_strategy") is env.by_field("sharding_strategy")
    assert env.by_config_key("fsdp_nonsense") is None


def test_every_plugin_field_in_the_table_exists_on_the_plugin() -> None:
    fields = set(FullyShardedDataParallelPlugin.__dataclass_fields__)
    assert {v.field for v in env.FSDP_VARS} <= fields


@pytest.mark.parametrize(
    ("field", "text", "expected"),
    [
        ("sharding_strategy", "shard_grad_op", "SHARD_GRAD_OP"),
        ("sharding_strategy", "5", "HYBRID_SHARD_ZERO2"),
        ("reshard_after_forward", "FALSE", False),
        ("reshard_after_forward", "full_shard", "FULL_SHARD"),
        ("cpu_offload", "Yes", True),
        ("min_num_params", "1e8", 100_000_000),
        ("transformer_cls_names_to_wrap", "BertLayer, BertEmbeddings,", ["BertLayer", "BertEmbeddings"]),
        ("backward_prefetch", "no_prefetch", "NO_PREFETCH"),
        ("fsdp_version", "2", 2),
    ],
)
def test_parse(field: str, text: str, expected: object) -> None:
    assert env.by_field(field).parse(text) == expected


@pytest.mark.parametrize(
    ("variable", "text", "message"),
    [
        ("FSDP_OFFLOAD_PARAMS", "maybe", "environment variable FSDP_OFFLOAD_PARAMS='maybe': not a boolean."),
        (
            "FSDP_SHARDING_STRATEGY",
            "ZERO3",
            "environment variable FSDP_SHARDING_STRATEGY='ZERO3': not a valid choice. Use one of FULL_SHARD, "
            "SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2.",
        ),
        ("FSDP_MIN_NUM_PARAMS", "lots", "environment variable FSDP_MIN_NUM_PARAMS='lots': not an integer."),
        ("FSDP_VERSION", "3", "environment variable FSDP_VERSION='3': FSDP version must be 1 or 2."),
        (
            "FSDP_RESHARD_AFTER_FORWARD",
            "sometimes",
            "environment variable FSDP_RESHARD_AFTER_FORWARD='sometimes': expected true/false (fsdp_version 2)",
        ),
    ],
)
def test_malformed_variable_names_itself(
    monkeypatch: pytest.MonkeyPatch, variable: str, text: str, message: str
) -> None:
    monkeypatch.setenv(variable, text)
    with pytest.raises(ValueError, match=re.escape(message)):
        FullyShardedDataParallelPlugin()


def test_unset_empty_and_none_text_are_ignored() -> None:
    assert env.read_env({"FSDP_STATE_DICT_TYPE": "None", "FSDP_IGNORED_MODULES": "", "OTHER": "x"}) == {}


def test_format_env_rejects_unknown_fields() -> None:
    with pytest.raises(KeyError, match="no environment variable for \\['colour'\\]"):
        env.format_env({"colour": "red"})


def _table_fields(plugin: FullyShardedDataParallelPlugin) -> dict[str, object]:
    return {v.field: getattr(plugin, v.field) for v in env.FSDP_VARS}


ROUND_TRIP_CASES = {
    "fsdp1": dict(
        fsdp_version=1,
        sharding_strategy="HYBRID_SHARD",
        cpu_offload=True,
        min_num_params=12345,
        auto_wrap_policy="size_based_wrap",
        transformer_cls_names_to_wrap=["Block", "Embed"],
        backward_prefetch="BACKWARD_POST",
        state_dict_type="LOCAL_STATE_DICT",
        forward_prefetch=True,
        use_orig_params=True,
        cpu_ram_efficient_loading=True,
        sync_module_states=True,
        activation_checkpointing=True,
        ignored_modules=r"encoder\.layers\.[01]",
    ),
    "fsdp2": dict(
        fsdp_version=2,
        reshard_after_forward=False,
        cpu_offload=True,
        min_num_params=7,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        backward_prefetch="BACKWARD_PRE",
        state_dict_type="FULL_STATE_DICT",
        activation_checkpointing=True,
        ignored_modules="head",
        invariant_micro_batches=8,
    ),
    "defaults": dict(),
}


@pytest.mark.parametrize("case", sorted(ROUND_TRIP_CASES))
def test_plugin_env_plugin_round_trip(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    # - Set up: a plugin from explicit arguments.
    original = FullyShardedDataParallelPlugin(**ROUND_TRIP_CASES[case])
    # - Run: its environment, then a plugin built from that environment only.
    variables = original.to_env()
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    rebuilt = FullyShardedDataParallelPlugin()
    # - Check: every table field survives.
    assert _table_fields(rebuilt) == _table_fields(original)
    assert rebuilt.state_dict_config == original.state_dict_config
    assert rebuilt.cpu_offload == original.cpu_offload


def test_round_trip_covers_every_variable() -> None:
    written = set()
    for kwargs in ROUND_TRIP_CASES.values():
        written |= set(FullyShardedDataParallelPlugin(**kwargs).to_env())
    assert written == {v.env for v in env.FSDP_VARS}


def test_environment_written_by_accelerate_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    # What `accelerate launch` writes for seed 001's config with fsdp_version 1 (note the lower case).
    accelerate_env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "1",
        "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
        "FSDP_RESHARD_AFTER_FORWARD": "shard_grad_op",
        "FSDP_OFFLOAD_PARAMS": "false",
        "FSDP_MIN_NUM_PARAMS": "100000000",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "BertLayer",
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        "FSDP_FORWARD_PREFETCH": "false",
        "FSDP_USE_ORIG_PARAMS": "true",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
        "FSDP_SYNC_MODULE_STATES": "true",
        "FSDP_ACTIVATION_CHECKPOINTING": "false",
    }
    for name, value in accelerate_env.items():
        monkeypatch.setenv(name, value)
    plugin = FullyShardedDataParallelPlugin()
    # fsdp_reshard_after_forward (the config key Accelerate's questions write) beats the flag's default.
    assert plugin.sharding_strategy.name == "SHARD_GRAD_OP"
    assert plugin.transformer_cls_names_to_wrap == ["BertLayer"]
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert (plugin.use_orig_params, plugin.cpu_ram_efficient_loading, plugin.sync_module_states) == (True, True, True)
    assert env.read_launch_env()["use_fsdp"] is True


@pytest.mark.parametrize(
    ("version", "strategy", "reshard", "expected"),
    [
        ("2", "FULL_SHARD", "false", "SHARD_GRAD_OP"),  # v2 config; FSDP_SHARDING_STRATEGY is the flag default
        ("1", "SHARD_GRAD_OP", "true", "SHARD_GRAD_OP"),  # --fsdp_sharding_strategy; reshard is the flag default
        ("1", "FULL_SHARD", "no_shard", "NO_SHARD"),  # v1 config's fsdp_reshard_after_forward
    ],
)
def test_accelerate_writes_both_sharding_variables(
    monkeypatch: pytest.MonkeyPatch, version: str, strategy: str, reshard: str, expected: str
) -> None:
    monkeypatch.setenv("FSDP_VERSION", version)
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", strategy)
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", reshard)
    plugin = FullyShardedDataParallelPlugin()
    if version == "2":  # version 2 keeps only reshard_after_forward, as Accelerate's plugin does
        assert (plugin.sharding_strategy, plugin.reshard_after_forward) == (None, expected == "FULL_SHARD")
    else:
        assert plugin.sharding_strategy.name == expected


def test_patched_sets_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("FSDP_VERSION", "1")
    with env.patched({"FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"}):
        assert env.read_env() == {"fsdp_version": 2, "cpu_offload": True}
    assert os.environ["FSDP_VERSION"] == "1" and "FSDP_OFFLOAD_PARAMS" not in os.environ

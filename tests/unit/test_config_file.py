"""Config files: seed 001's Accelerate YAML loads as is, unknown keys are named, files round-trip."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from fullshard.cli.config_file import LaunchConfig, default_config_path, load_config, override, save_config
from fullshard.cli.launch_plan import launch_env

# Seed 001 (Accelerate's FSDP guide), verbatim.
SEED_001_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch_policy: BACKWARD_PRE
  fsdp_forward_prefetch: false
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_seed_001_yaml_loads_as_is(tmp_path: Path) -> None:
    cfg, source = load_config(_write(tmp_path, SEED_001_YAML))
    assert source == tmp_path / "config.yaml"
    assert cfg.use_fsdp and cfg.num_processes == 2 and cfg.mixed_precision == "bf16"
    assert cfg.fsdp_config == {
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "backward_prefetch": "BACKWARD_PRE",  # the old key fsdp_backward_prefetch_policy
        "forward_prefetch": False,
        "cpu_ram_efficient_loading": True,
        "cpu_offload": False,
        "sharding_strategy": "FULL_SHARD",
        "state_dict_type": "SHARDED_STATE_DICT",
        "sync_module_states": True,
        "transformer_cls_names_to_wrap": ["BertLayer"],
        "use_orig_params": True,
    }
    assert cfg.extra["tpu_env"] == [] and cfg.extra["same_network"] is True


def test_seed_001_yaml_becomes_the_workers_environment(tmp_path: Path) -> None:
    cfg, _ = load_config(_write(tmp_path, SEED_001_YAML))
    assert launch_env(cfg) == {
        "ACCELERATE_USE_FSDP": "true",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_USE_CPU": "false",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE",
        "FSDP_FORWARD_PREFETCH": "false",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
        "FSDP_OFFLOAD_PARAMS": "false",
        "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        "FSDP_SYNC_MODULE_STATES": "true",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "BertLayer",
        "FSDP_USE_ORIG_PARAMS": "true",
        "FSDP_VERSION": "1",  # the file names none: the default, written out as `accelerate launch` does
    }


def test_round_trip(tmp_path: Path) -> None:
    cfg, _ = load_config(_write(tmp_path, SEED_001_YAML))
    saved = save_config(cfg, tmp_path / "out" / "again.yaml")
    again, _ = load_config(saved)
    assert again == cfg
    # The file written is still Accelerate's format: same top-level keys as the seed.
    assert set(yaml.safe_load(saved.read_text())) == set(yaml.safe_load(SEED_001_YAML))


def test_round_trip_of_fullshard_settings(tmp_path: Path) -> None:
    cfg = LaunchConfig(
        distributed_type="fsdp",
        num_processes=4,
        num_machines=2,
        machine_rank=1,
        main_process_ip="10.0.0.1",
        main_process_port=1234,
        rdzv_backend="C10D",
        max_restarts=3,
        fsdp_config={"fsdp_version": 2, "fsdp_reshard_after_forward": "false", "fsdp_min_num_params": "1e6"},
    )
    assert load_config(save_config(cfg, tmp_path / "c.yaml"))[0] == cfg
    assert cfg.fsdp_config == {"fsdp_version": 2, "reshard_after_forward": False, "min_num_params": 1_000_000}
    assert (cfg.distributed_type, cfg.rdzv_backend) == ("FSDP", "c10d")


def test_unknown_keys_are_named(tmp_path: Path) -> None:
    path = _write(tmp_path, SEED_001_YAML + "num_gpus: 2\nzero_stage: 3\n")
    with pytest.raises(
        ValueError, match=re.escape(f"config file {str(path)!r}: unknown keys ['num_gpus', 'zero_stage']")
    ):
        load_config(path)
    with pytest.raises(ValueError, match="Remove them or fix their spelling; known keys are "):
        load_config(path)


def test_unknown_fsdp_keys_are_named(tmp_path: Path) -> None:
    path = _write(tmp_path, SEED_001_YAML.replace("fsdp_use_orig_params", "fsdp_use_original_params"))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "fsdp_config has an unknown key 'fsdp_use_original_params' (did you mean fsdp_use_orig_params?). "
            "Remove it or use one of:"
        ),
    ):
        load_config(path)


def test_a_misspelt_key_gets_a_suggestion(tmp_path: Path) -> None:
    path = _write(tmp_path, "num_proceses: 2\nmixed_precison: bf16\n")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "unknown keys ['mixed_precison', 'num_proceses'] (did you mean mixed_precision or num_processes?)."
        ),
    ):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("distributed_type: DEEPSPEED\n", "distributed_type='DEEPSPEED': not supported by fullshard. Use one of NO,"),
        ("num_processes: 0\n", "num_processes=0: must be at least 1."),
        ("num_processes: two\n", "num_processes='two': not an integer. Give a whole number such as 2."),
        ("max_restarts: often\n", "max_restarts='often': not an integer. Give a whole number such as 3."),
        ("num_machines: 2\nmachine_rank: 2\n", "machine_rank=2: must be between 0 and num_machines - 1 = 1."),
        ("mixed_precision: fp8\n", "mixed_precision='fp8': not a valid choice. Use one of no, fp16, bf16."),
        ("rdzv_backend: etcd\n", "rdzv_backend='etcd': not supported by fullshard. Use one of static, c10d."),
        ("main_process_port: 70000\n", "main_process_port=70000: not a port"),
        ("fsdp_config:\n  fsdp_offload_params: maybe\n", "fsdp_config.fsdp_offload_params='maybe': not a boolean."),
        (
            "fsdp_config:\n  fsdp_backward_prefetch: BACKWARD_PRE\n  fsdp_backward_prefetch_policy: BACKWARD_PRE\n",
            "fsdp_config sets fsdp_backward_prefetch twice (as 'fsdp_backward_prefetch_policy'). Keep one of them.",
        ),
        ("- a list\n", "expected a mapping of keys to values, got list."),
    ],
)
def test_bad_values(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(_write(tmp_path, text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("no such file. Run `fullshard config` to write one")):
        load_config(tmp_path / "nope.yaml")


def test_default_location_and_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FULLSHARD_HOME", str(tmp_path / "home"))
    assert default_config_path() == tmp_path / "home" / "default_config.yaml"
    assert load_config() == (LaunchConfig(), None)
    save_config(LaunchConfig(num_processes=3), default_config_path())
    assert load_config()[0].num_processes == 3
    monkeypatch.delenv("FULLSHARD_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_config_path() == tmp_path / "xdg" / "fullshard" / "default_config.yaml"


def test_override_merges_flags_into_the_file(tmp_path: Path) -> None:
    cfg, _ = load_config(_write(tmp_path, SEED_001_YAML))
    new = override(
        cfg,
        {"num_processes": 4, "fsdp_offload_params": "true", "fsdp_version": "2", "cpu": True, "use_fsdp": False},
    )
    assert new.num_processes == 4 and new.use_cpu is True and new.use_fsdp is True
    assert new.fsdp_config["cpu_offload"] is True and new.fsdp_config["fsdp_version"] == 2
    assert new.fsdp_config["use_orig_params"] is True  # kept from the file
    assert cfg.fsdp_config["cpu_offload"] is False  # the original is untouched
    with pytest.raises(ValueError, match=re.escape("--fsdp_offload_params='perhaps': not a boolean.")):
        override(cfg, {"fsdp_offload_params": "perhaps"})


# Accelerate's dynamo_config section, as `accelerate config` writes it after "yes" to torch dynamo.
DYNAMO_YAML = """\
dynamo_config:
  dynamo_backend: INDUCTOR
  dynamo_mode: max-autotune
  dynamo_use_dynamic: false
  dynamo_use_fullgraph: true
  dynamo_use_regional_compilation: true
"""


def test_dynamo_config_round_trip_and_workers_environment(tmp_path: Path) -> None:
    # Was: dynamo_config passed through unused (no variables for the workers).
    cfg, _ = load_config(_write(tmp_path, SEED_001_YAML + DYNAMO_YAML))
    assert cfg.dynamo_config == {
        "backend": "INDUCTOR",
        "mode": "max-autotune",
        "dynamic": False,
        "fullgraph": True,
        "use_regional_compilation": True,
    }
    saved = save_config(cfg, tmp_path / "again.yaml")
    assert load_config(saved)[0] == cfg
    assert yaml.safe_load(saved.read_text())["dynamo_config"] == yaml.safe_load(DYNAMO_YAML)["dynamo_config"]
    assert {k: v for k, v in launch_env(cfg).items() if "DYNAMO" in k} == {
        "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR",
        "ACCELERATE_DYNAMO_MODE": "max-autotune",
        "ACCELERATE_DYNAMO_USE_DYNAMIC": "false",
        "ACCELERATE_DYNAMO_USE_FULLGRAPH": "true",
        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "true",
    }
    # Without FSDP too; flags override the file; keys without the prefix and the old top-level key, as Accelerate.
    plain = override(LaunchConfig(dynamo_config={"backend": "inductor", "use_fullgraph": True}),
                     {"dynamo_backend": "aot_eager", "dynamo_use_fullgraph": False, "dynamo_mode": None})  # fmt: skip
    assert launch_env(plain)["ACCELERATE_DYNAMO_BACKEND"] == "AOT_EAGER" and plain.dynamo_config["fullgraph"] is False
    old, _ = load_config(_write(tmp_path, "dynamo_backend: eager\n"))
    assert old.dynamo_config == {"backend": "EAGER"} and "dynamo_backend" not in old.to_dict()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "dynamo_config:\n  dynamo_use_full_graph: true\n",
            "dynamo_config has an unknown key 'dynamo_use_full_graph' (did you mean dynamo_use_fullgraph?). Remove it "
            "or use one of: dynamo_backend, dynamo_mode,",
        ),
        (
            "dynamo_config:\n  dynamo_backend: inductr\n",
            "dynamo_config.dynamo_backend='inductr': not a torch.compile backend. Use one of no, eager, aot_eager,",
        ),
        ("dynamo_config:\n  dynamo_mode: fast\n", "dynamo_config.dynamo_mode='fast': not a valid choice."),
        ("dynamo_config: inductor\n", "dynamo_config='inductor': expected a mapping of dynamo_* keys to values."),
    ],
)
def test_bad_dynamo_config(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(_write(tmp_path, text))

"""ParallelismConfig without ranks: sizes from arguments and PARALLELISM_CONFIG_*, Accelerate's mesh layout, the
refusals (cp/sp, TP with replication only, bad sizes), and the launcher's variables from a config section."""

from __future__ import annotations

import pytest

from fullshard import Accelerator, ParallelismConfig
from fullshard.accelerate import ParallelismConfig as AccelerateParallelismConfig
from fullshard.accelerate.parallelism_config import ParallelismConfig as ModuleParallelismConfig
from fullshard.cli.config_file import LaunchConfig
from fullshard.cli.launch_plan import launch_env
from fullshard.frontend import env
from fullshard.utils import ParallelismConfig as UtilsParallelismConfig


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in env.PARALLELISM_VARS:
        monkeypatch.delenv(var.env, raising=False)


def test_one_class_at_accelerates_paths() -> None:
    assert ParallelismConfig is AccelerateParallelismConfig is ModuleParallelismConfig is UtilsParallelismConfig


def test_sizes_from_arguments_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "4")
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size) == (2, 2, 2)
    assert config.total_size == 8 and config.data_parallel_size == 4 and config.non_data_parallel_size == 2
    assert config._get_mesh() == (("dp_replicate", "dp_shard", "tp"), (2, 2, 2))
    assert config.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert config.dp_dim_names == ["dp_replicate", "dp_shard"] and config.non_dp_dim_names == ["tp"]
    assert config.tp_handler is not None
    assert ParallelismConfig(dp_shard_size=4)._get_mesh() == (("dp_shard", "tp"), (4, 2))
    monkeypatch.delenv("PARALLELISM_CONFIG_TP_SIZE")
    assert ParallelismConfig()._get_mesh() == (("dp_shard",), (4,))
    assert ParallelismConfig(dp_shard_size=1)._get_mesh() == ()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"cp_size": 2}, NotImplementedError, "ParallelismConfig(cp_size=2): fullshard has no context parallelism"),
        ({"sp_size": 2}, NotImplementedError, "ParallelismConfig(sp_size=2): fullshard has no sequence parallelism"),
        ({"dp_replicate_size": 2, "tp_size": 2}, ValueError, "tensor parallelism combines with sharding"),
        ({"tp_size": 0}, ValueError, "ParallelismConfig(tp_size=0): must be an integer of at least 1."),
    ],
)
def test_refused(kwargs: dict[str, int], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as raised:
        ParallelismConfig(**kwargs)
    assert message in str(raised.value)


def test_accelerator_without_parallelism() -> None:
    accelerator = Accelerator(parallelism_config=ParallelismConfig())  # one process, every size 1: no mesh
    assert accelerator.torch_device_mesh is None and accelerator.tensor_parallel_rank == 0
    assert Accelerator().parallelism_config is None
    with pytest.raises(TypeError, match="expected a ParallelismConfig"):
        Accelerator(parallelism_config={"tp_size": 2})


def _launch_env(section: object, num_processes: int = 4, version: int = 2) -> dict[str, str]:
    data = {"distributed_type": "FSDP", "num_processes": num_processes, "fsdp_config": {"fsdp_version": version},
            "parallelism_config": section}  # fmt: skip
    return launch_env(LaunchConfig.from_dict(data))


def test_launcher_passes_the_section() -> None:
    section = {"parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 2, "tp_size": 2}
    variables = _launch_env(section)
    assert variables["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert variables["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "2" and variables["PARALLELISM_CONFIG_TP_SIZE"] == "2"
    assert variables["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "1"
    assert env.read_parallelism_env(variables) == {"use_parallelism_config": True, "dp_replicate_size": 1,
                                                   "dp_shard_size": 2, "tp_size": 2}  # fmt: skip
    assert not any(k.startswith(("PARALLELISM", "ACCELERATE_USE_PARALLELISM")) for k in _launch_env({}))
    with pytest.raises(ValueError, match="unknown key 'parallelism_config_tp_sise'"):
        _launch_env({"parallelism_config_tp_sise": 2})
    with pytest.raises(ValueError, match="multiply to 8, but num_processes is 4"):
        _launch_env({"dp_shard_size": 4, "tp_size": 2})
    with pytest.raises(ValueError, match="parallelism_config with FSDP version 1"):
        _launch_env({"dp_shard_size": 4}, version=1)

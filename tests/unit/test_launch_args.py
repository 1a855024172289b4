"""build_launch: the torch.distributed.run arguments and worker environment, without starting anything."""

from __future__ import annotations

import argparse
import re

import pytest
import torch.distributed.run as torchrun

from fullshard.cli.commands.config import default_config
from fullshard.cli.commands.launch import torchrun_spellings
from fullshard.cli.config_file import LaunchConfig, override
from fullshard.cli.launch_plan import build_launch, launch_env
from fullshard.frontend import env
from fullshard.frontend.plugin import FullyShardedDataParallelPlugin


def _parsed(argv: list[str]) -> argparse.Namespace:
    """torch's own parser accepts the arguments (and tells us what it understood)."""
    return torchrun.get_args_parser().parse_args(argv)


def test_single_node_without_port_is_standalone() -> None:
    plan = build_launch(LaunchConfig(num_processes=2), "train.py", ["--lr", "1e-3"])
    assert plan.argv == [
        "--nnodes", "1", "--nproc_per_node", "2", "--standalone", "--max_restarts", "0",
        "--module", "fullshard.cli.worker", "train.py", "--lr", "1e-3",
    ]  # fmt: skip
    args = _parsed(plan.argv)
    # The workers run the script through fullshard's worker module, which records a failure per rank.
    assert (args.standalone, args.module, args.training_script) == (True, True, "fullshard.cli.worker")
    assert args.training_script_args == ["train.py", "--lr", "1e-3"]


def test_single_node_with_port() -> None:
    plan = build_launch(LaunchConfig(num_processes=4, main_process_port=29555), "train.py")
    args = _parsed(plan.argv)
    assert (args.nproc_per_node, args.rdzv_backend, args.master_addr, args.master_port) == (
        "4",
        "static",
        "127.0.0.1",
        29555,
    )
    assert not args.standalone


def test_multi_node_static() -> None:
    cfg = LaunchConfig(num_processes=8, num_machines=2, machine_rank=1, main_process_ip="10.1.2.3")
    args = _parsed(build_launch(cfg, "train.py").argv)
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "4", 1)
    assert (args.rdzv_backend, args.master_addr, args.master_port) == ("static", "10.1.2.3", 29500)


@pytest.mark.parametrize(("machine_rank", "is_host"), [(0, "true"), (1, "false")])
def test_multi_node_c10d(machine_rank: int, is_host: str) -> None:
    cfg = LaunchConfig(
        num_processes=2,
        num_machines=2,
        machine_rank=machine_rank,
        main_process_ip="10.1.2.3",
        main_process_port=6000,
        rdzv_backend="c10d",
    )
    args = _parsed(build_launch(cfg, "train.py").argv)
    assert (args.nnodes, args.nproc_per_node) == ("2", "1")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_conf) == ("c10d", "10.1.2.3:6000", f"is_host={is_host}")


def test_max_restarts_and_module() -> None:
    args = _parsed(build_launch(LaunchConfig(max_restarts=3), "pkg.train", ["--x"], module=True).argv)
    assert (args.max_restarts, args.module, args.training_script) == (3, True, "fullshard.cli.worker")
    assert args.training_script_args == ["-m", "pkg.train", "--x"]


def test_log_dir_and_shutdown_timeout() -> None:
    plan = build_launch(LaunchConfig(num_processes=2), "train.py", log_dir="/tmp/logs", shutdown_timeout=5)
    args = _parsed(plan.argv)
    assert (args.log_dir, args.tee, args.shutdown_timeout) == ("/tmp/logs", "3", 5)
    assert (plan.log_dir, plan.local_world_size) == ("/tmp/logs", 2)


def test_flags_override_the_file() -> None:
    from_file = LaunchConfig(
        distributed_type="FSDP",
        num_processes=2,
        mixed_precision="bf16",
        fsdp_config={"fsdp_offload_params": False, "fsdp_state_dict_type": "SHARDED_STATE_DICT"},
    )
    flags = {"num_processes": 3, "mixed_precision": "no", "fsdp_offload_params": "true", "fsdp_version": "2"}
    plan = build_launch(override(from_file, flags), "train.py")
    assert _parsed(plan.argv).nproc_per_node == "3"
    assert plan.env == {
        "ACCELERATE_USE_FSDP": "true",
        "ACCELERATE_MIXED_PRECISION": "no",
        "ACCELERATE_USE_CPU": "false",
        "FSDP_OFFLOAD_PARAMS": "true",
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        "FSDP_VERSION": "2",
    }


def test_without_fsdp_no_fsdp_variables() -> None:
    cfg = LaunchConfig(num_processes=2, use_cpu=True, debug=True, fsdp_config={"fsdp_offload_params": True})
    assert build_launch(cfg, "train.py").env == {
        "ACCELERATE_USE_FSDP": "false",
        "ACCELERATE_MIXED_PRECISION": "no",
        "ACCELERATE_USE_CPU": "true",
        "ACCELERATE_DEBUG_MODE": "true",
    }


def test_cpu_ram_efficient_loading_turns_on_sync() -> None:
    cfg = LaunchConfig(distributed_type="FSDP", fsdp_config={"fsdp_cpu_ram_efficient_loading": True})
    assert build_launch(cfg, "t.py").env["FSDP_SYNC_MODULE_STATES"] == "true"
    cfg.fsdp_config["sync_module_states"] = False
    with pytest.raises(ValueError, match=re.escape("Set fsdp_sync_module_states to true (or leave it out).")):
        build_launch(cfg, "t.py")


def test_multi_node_needs_the_main_address() -> None:
    with pytest.raises(ValueError, match=re.escape("num_machines=2 without main_process_ip: every machine must know")):
        build_launch(LaunchConfig(num_processes=2, num_machines=2), "t.py")


def test_processes_must_divide_over_machines() -> None:
    cfg = LaunchConfig(num_processes=3, num_machines=2, main_process_ip="h")
    with pytest.raises(
        ValueError, match=re.escape("num_processes=3 with num_machines=2: num_processes counts the processes of all")
    ):
        build_launch(cfg, "t.py")


# --- torchrun's spellings and the default FSDP version ------------------------------------------------------


def test_torchrun_spellings_become_fullshards() -> None:
    flags = {"nproc_per_node": 2, "nnodes": 3, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 6000}
    assert torchrun_spellings(flags, machines_in_file=1) == {
        "num_processes": 6,  # 2 per machine on 3 machines
        "num_machines": 3,
        "machine_rank": 1,
        "main_process_ip": "10.0.0.1",
        "main_process_port": 6000,
    }
    # Per machine times the machines of the config file when no flag gives them; the other flags pass through.
    assert torchrun_spellings({"nproc_per_node": 4, "use_fsdp": True}, machines_in_file=2) == {
        "use_fsdp": True,
        "num_processes": 8,
    }
    assert torchrun_spellings({"rdzv_endpoint": "host-a:29400"}, machines_in_file=1) == {
        "main_process_ip": "host-a",
        "main_process_port": 29400,
    }
    # Both spellings with one value is fine; with two values, the error names both.
    assert torchrun_spellings({"num_machines": 2, "nnodes": 2}, 1) == {"num_machines": 2}
    with pytest.raises(ValueError, match=re.escape("--num_processes 4 and --nproc_per_node 1 x 2 machines = 2 set")):
        torchrun_spellings({"num_processes": 4, "num_machines": 2, "nproc_per_node": 1}, 1)
    with pytest.raises(ValueError, match=re.escape("--rdzv_endpoint 'host-a': expected HOST:PORT")):
        torchrun_spellings({"rdzv_endpoint": "host-a"}, 1)


def test_rdzv_id_and_conf_reach_torchrun() -> None:
    single = _parsed(build_launch(LaunchConfig(), "t.py", rdzv_id="job7", rdzv_conf="timeout=60").argv)
    assert (single.rdzv_id, single.rdzv_conf) == ("job7", "timeout=60")
    cfg = LaunchConfig(num_processes=2, num_machines=2, machine_rank=1, main_process_ip="h", rdzv_backend="c10d")
    # c10d on several machines: fullshard's is_host entry is added unless the given conf sets it.
    assert _parsed(build_launch(cfg, "t.py", rdzv_conf="timeout=60").argv).rdzv_conf == "is_host=false,timeout=60"
    assert _parsed(build_launch(cfg, "t.py", rdzv_conf="is_host=true").argv).rdzv_conf == "is_host=true"


def test_one_default_fsdp_version() -> None:
    # Accelerate 1.15's plugin and `accelerate launch` take FSDP version 1 when nothing names one; so do
    # fullshard's plugin, `fullshard launch --use_fsdp` without a config file, and `fullshard config default`.
    assert env.DEFAULT_FSDP_VERSION == 1
    assert FullyShardedDataParallelPlugin().fsdp_version == 1
    assert launch_env(LaunchConfig(distributed_type="FSDP"))["FSDP_VERSION"] == "1"
    assert default_config().fsdp_config["fsdp_version"] == 1
    assert launch_env(default_config())["FSDP_VERSION"] == "1"


# --- an elastic range of machines (torchrun's --nnodes MIN:MAX) ----------------------------------------------


def test_nnodes_range_becomes_min_and_num_machines() -> None:
    assert torchrun_spellings({"nnodes": "1:2", "nproc_per_node": 2}, machines_in_file=1) == {
        "num_machines": 2,
        "min_machines": 1,
        "num_processes": 4,  # 2 per machine on at most 2 machines
    }
    assert torchrun_spellings({"nnodes": "3"}, 1) == {"num_machines": 3}
    assert torchrun_spellings({"nnodes": "2:2"}, 1) == {"num_machines": 2}  # no range: a fixed count
    for bad in ("0:2", "2:1", "a:b", "1:2:3", ""):
        with pytest.raises(ValueError, match=re.escape(f"--nnodes {bad!r}: expected a number of machines")):
            torchrun_spellings({"nnodes": bad}, 1)


def test_elastic_range_reaches_torchrun_without_is_host() -> None:
    cfg = override(LaunchConfig(), torchrun_spellings(
        {"nnodes": "1:2", "nproc_per_node": 2, "rdzv_endpoint": "localhost:29400", "max_restarts": 3}, 1))  # fmt: skip
    cfg = override(cfg, {"rdzv_backend": "c10d"})
    args = _parsed(build_launch(cfg, "t.py", rdzv_conf="last_call_timeout=5").argv)
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == ("1:2", "2", 3)
    # No is_host: the first launcher on the endpoint's host hosts the store, the others connect (as torchrun).
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_conf) == ("c10d", "localhost:29400", "last_call_timeout=5")
    assert "min_machines" not in LaunchConfig().to_dict() and cfg.to_dict()["min_machines"] == 1


def test_elastic_range_needs_c10d_and_an_endpoint() -> None:
    with pytest.raises(ValueError, match=re.escape("--nnodes 1:2 with rdzv_backend='static': an elastic range")):
        build_launch(LaunchConfig(num_processes=4, num_machines=2, min_machines=1, main_process_ip="h"), "t.py")
    with pytest.raises(ValueError, match=re.escape("--nnodes 1:2 without an endpoint")):
        build_launch(LaunchConfig(num_processes=4, num_machines=2, min_machines=1, rdzv_backend="c10d"), "t.py")
    with pytest.raises(ValueError, match=re.escape("min_machines=3 with num_machines=2")):
        LaunchConfig(num_machines=2, min_machines=3)

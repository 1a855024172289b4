"""build_launch: the torch.distributed.run arguments and worker environment, without starting anything."""

from __future__ import annotations

import argparse
import re

import pytest
import torch.distributed.run as torchrun

from fullshard.cli.config_file import LaunchConfig, override
from fullshard.cli.launch import build_launch


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

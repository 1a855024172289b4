"""The `fullshard` command end to end: config files, env, launching workers on one and two "machines"."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed.run as torchrun
import yaml
from click.testing import CliRunner

from fullshard.cli.config_file import LaunchConfig, load_config, save_config
from fullshard.cli.main import cli
from fullshard.frontend import env

SRC = Path(__file__).resolve().parents[2] / "src"
WORKER = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    launch = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("FSDP_", "ACCELERATE_")))
    # One write per line: the launcher runs workers unbuffered, and print() writes the newline apart,
    # so two ranks' lines could interleave.
    sys.stdout.write(f"RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']} SUM={total.item():g} "
                     f"ARGS={sys.argv[1:]} {launch}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    """
)


@pytest.fixture
def child_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a `fullshard` child process: this worktree's code, a private config home."""
    variables = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    variables.update(PYTHONPATH=str(SRC), FULLSHARD_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    return variables


def _fullshard(args: list[str], child_env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fullshard.cli.main", *args],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _worker(tmp_path: Path) -> str:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_config_path_in(tmp_path: Path) -> Path:
    """Where the child processes (FULLSHARD_HOME=tmp_path/home) look for the default config file."""
    return tmp_path / "home" / "default_config.yaml"


def _rank_lines(output: str) -> dict[str, str]:
    return {line.split()[0]: line for line in output.splitlines() if line.startswith("RANK=")}


# --- config -------------------------------------------------------------------------------------------------


def test_config_default_writes_a_file_once(tmp_path: Path, child_env: dict[str, str]) -> None:
    result = _fullshard(["config", "default", "--mixed_precision", "bf16"], child_env)
    assert result.returncode == 0, result.stderr
    path = tmp_path / "home" / "default_config.yaml"
    assert f"saved at {path}" in result.stdout
    cfg, _ = load_config(path)
    assert cfg.use_fsdp and cfg.mixed_precision == "bf16" and cfg.fsdp_config["fsdp_version"] == 1
    assert "dynamo_config" not in path.read_text()  # as Accelerate's basic config: nothing compiled

    again = _fullshard(["config", "default"], child_env)
    assert again.returncode == 1
    assert "configuration already exists at" in again.stderr and "--overwrite" in again.stderr


def test_config_questions_interactive(tmp_path: Path) -> None:
    target = tmp_path / "asked.yaml"
    # use_cpu, num_machines, dynamo, use_fsdp, version, strategy, offload, wrap, no_split?, classes, prefetch,
    # state dict, forward prefetch, orig params, ram-efficient loading, checkpointing, processes, precision
    answers = ["yes", "1", "no", "yes", "1", "shard_grad_op", "no", "transformer_based_wrap", "no", "Block,Attention",
               "BACKWARD_POST", "", "no", "yes", "yes", "no", "2", "bf16"]  # fmt: skip
    result = CliRunner().invoke(cli, ["config", "--config_file", str(target)], input="\n".join(answers) + "\n")
    assert result.exit_code == 0, result.output
    assert "What should be your sharding strategy?" in result.output
    data = yaml.safe_load(target.read_text())
    assert data["distributed_type"] == "FSDP" and data["num_processes"] == 2 and data["use_cpu"] is True
    assert "dynamo_config" not in data  # no to torch dynamo: no section, as Accelerate writes it
    assert data["fsdp_config"] == {
        "fsdp_version": 1,
        "fsdp_reshard_after_forward": "SHARD_GRAD_OP",
        "fsdp_offload_params": False,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "Block,Attention",
        "fsdp_backward_prefetch": "BACKWARD_POST",
        "fsdp_state_dict_type": "FULL_STATE_DICT",
        "fsdp_forward_prefetch": False,
        "fsdp_use_orig_params": True,
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_sync_module_states": True,
        "fsdp_activation_checkpointing": False,
    }


def test_config_asks_again_after_a_bad_answer(tmp_path: Path) -> None:
    answers = ["maybe", "yes", "1", "no", "no", "1", "no"]
    result = CliRunner().invoke(
        cli, ["config", "--config_file", str(tmp_path / "c.yaml")], input="\n".join(answers) + "\n"
    )
    assert result.exit_code == 0, result.output
    assert "answer='maybe': not a boolean." in result.output
    assert load_config(tmp_path / "c.yaml")[0].distributed_type == "NO"


def test_config_non_interactive_flags(tmp_path: Path) -> None:
    target = tmp_path / "c.yaml"
    args = ["config", "--config_file", str(target), "--non_interactive", "--use_cpu", "true", "--num_machines", "2",
            "--main_process_ip", "10.0.0.1", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP",
            "--num_processes", "4"]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    cfg, _ = load_config(target)
    assert (cfg.num_machines, cfg.main_process_ip, cfg.main_process_port, cfg.num_processes) == (
        2,
        "10.0.0.1",
        29500,
        4,
    )
    assert cfg.fsdp_config["min_num_params"] == 100_000_000 and cfg.fsdp_config["reshard_after_forward"] is True

    bad = CliRunner().invoke(cli, ["config", "--config_file", str(target), "--non_interactive", "--fsdp_version", "3"])
    assert bad.exit_code == 2 and "--fsdp_version='3': FSDP version must be 1 or 2." in bad.output


def test_config_asks_the_dynamo_questions(tmp_path: Path) -> None:
    target = tmp_path / "asked.yaml"
    # use_cpu, num_machines, dynamo, backend, customize, mode, fullgraph, dynamic, regional, use_fsdp, processes,
    # precision
    answers = ["yes", "1", "yes", "aot_eager", "yes", "max-autotune", "yes", "no", "yes", "no", "1", "no"]
    result = CliRunner().invoke(cli, ["config", "--config_file", str(target)], input="\n".join(answers) + "\n")
    assert result.exit_code == 0, result.output
    assert "Do you wish to optimize your script with torch dynamo?" in result.output
    assert "Do you want to enable regional compilation?" in result.output
    assert yaml.safe_load(target.read_text())["dynamo_config"] == {
        "dynamo_backend": "AOT_EAGER",
        "dynamo_mode": "max-autotune",
        "dynamo_use_fullgraph": True,
        "dynamo_use_dynamic": False,
        "dynamo_use_regional_compilation": True,
    }
    # An option answers its question and the ones leading to it; the rest take Accelerate's defaults.
    args = ["config", "--config_file", str(target), "--non_interactive", "--use_cpu", "true", "--dynamo_mode",
            "reduce-overhead"]  # fmt: skip
    assert CliRunner().invoke(cli, args).exit_code == 0
    assert load_config(target)[0].dynamo_config == {
        "backend": "INDUCTOR",
        "mode": "reduce-overhead",
        "fullgraph": False,
        "dynamic": False,
        "use_regional_compilation": False,
    }


# --- env ----------------------------------------------------------------------------------------------------


def test_env_prints_versions_and_config(tmp_path: Path, child_env: dict[str, str]) -> None:
    save_config(
        LaunchConfig(distributed_type="FSDP", fsdp_config={"fsdp_version": 2}), default_config_path_in(tmp_path)
    )
    result = _fullshard(["env"], {**child_env, "FSDP_OFFLOAD_PARAMS": "true", "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    for expected in ("fullshard environment", "torch", "Python", str(tmp_path / "home" / "default_config.yaml"),
                     "fsdp_config.fsdp_version", "FSDP_OFFLOAD_PARAMS"):  # fmt: skip
        assert expected in result.stdout


def test_env_names_the_versions_and_the_config_files_looked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fullshard.cli.commands.env import environment_rows

    # - Set up: no fullshard config file; an Accelerate default config file.
    monkeypatch.setenv("FULLSHARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    theirs = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    theirs.parent.mkdir(parents=True)
    theirs.write_text("distributed_type: FSDP\nnum_processes: 2\n")
    # - Run / Check: the versions, where the default file was looked for, and that Accelerate's is not used.
    rows = dict(environment_rows())
    for package in ("fullshard", "torch", "transformers", "accelerate", "numpy", "safetensors"):
        assert rows[package][0].isdigit(), (package, rows[package])
    ours = tmp_path / "home" / "default_config.yaml"
    assert rows["Config file"] == f"{ours} (the default; not found, so launch uses its defaults: 1 process, no FSDP)"
    assert rows["Accelerate's default config"] == f"{theirs} (exists, not used: pass --config_file {theirs} to use it)"
    rows = dict(environment_rows(str(theirs)))
    assert rows["Config file"] == f"{theirs} (given with --config_file; found)"
    assert rows["Accelerate's default config"] == f"{theirs} (exists, used)"
    assert rows["  num_processes"] == "2"


def test_env_shows_the_dynamo_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fullshard.cli.commands.env import environment_rows

    path = tmp_path / "c.yaml"
    save_config(LaunchConfig(dynamo_config={"dynamo_backend": "inductor", "dynamo_use_fullgraph": True}), path)
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune")
    rows = dict(environment_rows(str(path)))
    assert rows["  dynamo_config.dynamo_backend"] == "INDUCTOR"
    assert rows["Dynamo (torch.compile)"] == (
        "backend=inductor, mode=max-autotune, fullgraph=True, use_regional_compilation=False "
        "(from the config file and ACCELERATE_DYNAMO_* variables)"
    )
    assert rows["ACCELERATE_DYNAMO_MODE"] == "max-autotune"
    monkeypatch.delenv("ACCELERATE_DYNAMO_MODE")
    save_config(LaunchConfig(), path)
    rows = dict(environment_rows(str(path)))
    assert rows["Dynamo (torch.compile)"] == "backend no: the model is not compiled (the default)"


# --- launch -------------------------------------------------------------------------------------------------


def test_launch_two_processes(tmp_path: Path, child_env: dict[str, str]) -> None:
    args = ["launch", "--cpu", "--num_processes", "2", "--use_fsdp", "--fsdp_version", "2",
            "--fsdp_offload_params", "true", "--mixed_precision", "bf16", _worker(tmp_path), "--lr", "0.1"]  # fmt: skip
    result = _fullshard(args, child_env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = _rank_lines(result.stdout)
    assert set(lines) == {"RANK=0", "RANK=1"}
    for line in lines.values():
        for part in ("WORLD_SIZE=2", "SUM=3", "ARGS=['--lr', '0.1']", "ACCELERATE_USE_FSDP=true",
                     "ACCELERATE_MIXED_PRECISION=bf16", "FSDP_VERSION=2", "FSDP_OFFLOAD_PARAMS=true"):  # fmt: skip
            assert part in line


@pytest.mark.parametrize("rdzv_backend", ["static", "c10d"])
def test_launch_two_machines(tmp_path: Path, child_env: dict[str, str], rdzv_backend: str) -> None:
    # - Set up: two launches on this machine, one process each, meeting at 127.0.0.1.
    config = tmp_path / "multi.yaml"
    config.write_text(f"distributed_type: FSDP\nuse_cpu: true\nnum_processes: 2\nnum_machines: 2\n"
                      f"main_process_ip: 127.0.0.1\nmain_process_port: {_free_port()}\n"
                      f"rdzv_backend: {rdzv_backend}\n")  # fmt: skip
    worker = _worker(tmp_path)
    launches = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fullshard.cli.main",
                "launch",
                "--config_file",
                str(config),
                "--machine_rank",
                str(rank),
                worker,
            ],
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    # - Run
    outputs = []
    for launch in launches:
        stdout, stderr = launch.communicate(timeout=180)
        assert launch.returncode == 0, stdout + stderr
        outputs.append(stdout)
    # - Check: one rank per machine, both in one world of 2.
    lines = [_rank_lines(out) for out in outputs]
    assert all(len(found) == 1 for found in lines)
    assert {rank for found in lines for rank in found} == {"RANK=0", "RANK=1"}
    assert all("WORLD_SIZE=2 SUM=3" in line for found in lines for line in found.values())
    if rdzv_backend == "static":
        assert "RANK=0" in lines[0]


def test_launch_hands_the_dynamo_settings_to_the_workers(tmp_path: Path, child_env: dict[str, str]) -> None:
    # Set up: a config file with Accelerate's dynamo_config; flags that override three of its settings.
    config = tmp_path / "dynamo.yaml"
    config.write_text("distributed_type: 'NO'\nuse_cpu: true\ndynamo_config:\n  dynamo_backend: INDUCTOR\n"
                      "  dynamo_mode: max-autotune\n  dynamo_use_fullgraph: true\n"
                      "  dynamo_use_regional_compilation: true\n")  # fmt: skip
    script = tmp_path / "show.py"
    shown = "from fullshard.utils import TorchDynamoPlugin\np = TorchDynamoPlugin()\n"
    script.write_text(shown + "print('PLUGIN', p.to_kwargs(), p.use_regional_compilation)\n")
    # Run
    flags = ["--dynamo_backend", "aot_eager", "--no_dynamo_use_fullgraph", "--dynamo_use_dynamic"]
    result = _fullshard(["launch", "--config_file", str(config), *flags, str(script)], child_env)
    # Check: the worker's plugin has the flags' values where given (backend, fullgraph, dynamic), else the file's;
    # fullgraph=False is torch.compile's default, which to_kwargs leaves out as Accelerate's does.
    assert result.returncode == 0, result.stdout + result.stderr
    expected = "{'backend': 'aot_eager', 'mode': 'max-autotune', 'dynamic': True} True"
    assert f"PLUGIN {expected}" in result.stdout


def test_launch_reports_a_failed_worker(tmp_path: Path, child_env: dict[str, str]) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    result = _fullshard(["launch", "--cpu", str(script)], child_env)
    assert result.returncode == 3


def test_launch_shows_an_error_raised_on_every_rank_once(tmp_path: Path, child_env: dict[str, str]) -> None:
    script = tmp_path / "bad_wrap.py"
    # Both ranks reach the error together (after a barrier), so neither is stopped before it raises.
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()\n"
                      "def wrap():\n    raise ValueError('no module class Blok in the model')\nwrap()\n")  # fmt: skip
    result = _fullshard(["launch", "--cpu", "--num_processes", "2", str(script)], child_env)
    assert result.returncode == 1
    # Printed by the first rank to fail and once in the summary (was: by each rank, then by the summary).
    assert result.stderr.count("Traceback") == 2, result.stderr
    assert re.search(r"\[rank [01]\] ValueError: the same error and traceback as rank [01]\n", result.stderr)
    assert "error (the same on ranks 0, 1): ValueError: no module class Blok in the model" in result.stderr
    assert "then rank" not in result.stderr


def test_launch_rejects_bad_flags() -> None:
    result = CliRunner().invoke(cli, ["launch", "--fsdp_offload_params", "perhaps", "train.py"])
    assert result.exit_code == 2
    assert "--fsdp_offload_params='perhaps': not a boolean." in result.output
    result = CliRunner().invoke(cli, ["launch", "--num_machines", "2", "--num_processes", "2", "train.py"])
    assert result.exit_code == 2 and "without main_process_ip" in result.output


def test_launch_takes_torchrun_spellings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plans = []
    monkeypatch.setattr("fullshard.cli.commands.launch.run_launch", lambda plan: plans.append(plan) or 0)
    script = _worker(tmp_path)
    args = ["launch", "--config_file", str(tmp_path / "none.yaml")]
    (tmp_path / "none.yaml").write_text("use_cpu: true\n")
    result = CliRunner().invoke(cli, [*args, "--nproc_per_node", "2", "--master_port", "6001", script, "--x"])
    assert result.exit_code == 0, result.output
    parsed = torchrun.get_args_parser().parse_args(plans[0].argv)
    assert (parsed.nproc_per_node, parsed.master_port, parsed.training_script_args) == ("2", 6001, [script, "--x"])


def test_launch_warns_when_fsdp_flags_are_given_without_fsdp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Was: --fsdp_invariant_micro_batches without --use_fsdp trained in the default mode without a word.
    monkeypatch.setattr("fullshard.cli.commands.launch.run_launch", lambda plan: 0)
    (tmp_path / "none.yaml").write_text("use_cpu: true\n")
    base = ["launch", "--config_file", str(tmp_path / "none.yaml"), "--num_processes", "2"]
    script = _worker(tmp_path)
    off = CliRunner().invoke(cli, [*base, "--fsdp_invariant_micro_batches", "4", script])
    on = CliRunner().invoke(cli, [*base, "--use_fsdp", "--fsdp_invariant_micro_batches", "4", script])
    plain = CliRunner().invoke(cli, [*base, script])
    assert off.exit_code == on.exit_code == plain.exit_code == 0, off.output + on.output + plain.output
    assert "--fsdp_invariant_micro_batches has no effect: FSDP is off in this launch. Add --use_fsdp" in off.output
    assert "no effect" not in on.output and "no effect" not in plain.output


@pytest.mark.parametrize(
    ("flag", "suggestion"),
    [
        ("--nproc-per-nod", "--nproc-per-node"),
        ("--num_proceses", "--num_processes"),
        ("--fsdp_versio", "--fsdp_version"),
    ],
)
def test_launch_names_an_unknown_flag(flag: str, suggestion: str) -> None:
    # Was: "script '--nproc-per-nod' not found": the unknown flag was taken for the script.
    result = CliRunner().invoke(cli, ["launch", flag, "2", "train.py"])
    assert result.exit_code == 2
    assert f"No such option '{flag}'" in result.output and suggestion in result.output
    assert "not found" not in result.output


def test_env_table_flags_are_all_launch_options() -> None:
    options = {opt for param in cli.commands["launch"].params for opt in getattr(param, "opts", [])}
    assert {var.flag for var in (*env.FSDP_VARS, *env.DYNAMO_VARS)} <= options


# --- merge-weights ------------------------------------------------------------------------------------------


def test_merge_weights_calls_merge_fsdp_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fullshard.checkpoint

    calls = []
    # the command calls checkpoint's surface, as every package outside checkpoint/ does
    monkeypatch.setattr(
        fullshard.checkpoint, "merge_fsdp_weights", lambda *args, **kwargs: calls.append((args, kwargs)) or []
    )
    checkpoint = tmp_path / "pytorch_model_fsdp_0"
    checkpoint.mkdir()
    args = [
        "merge-weights",
        str(checkpoint),
        str(tmp_path / "out"),
        "--unsafe_serialization",
        "--remove_checkpoint_dir",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert calls == [
        ((str(checkpoint), str(tmp_path / "out")), {"safe_serialization": False, "remove_checkpoint_dir": True})
    ]
    CliRunner().invoke(cli, ["merge-weights", str(checkpoint), str(tmp_path / "out2")])
    assert calls[-1][1] == {"safe_serialization": True, "remove_checkpoint_dir": False}

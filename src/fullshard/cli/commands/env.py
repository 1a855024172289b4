"""``fullshard env``: versions, devices and the configuration in use, as a table to paste into a bug report."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import click

from fullshard.cli.config_file import LaunchConfig, accelerate_default_config_path, default_config_path, load_config
from fullshard.frontend import env

__all__ = ["env_command", "environment_rows"]


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _device_rows() -> list[tuple[str, str]]:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    rows = [
        ("torch", torch.__version__),
        ("CUDA available", f"{cuda} (CUDA {torch.version.cuda})" if cuda else str(cuda)),
        ("Backends", ", ".join(b for b in ("gloo", "nccl", "mpi") if getattr(dist, f"is_{b}_available")())),
        ("CPU cores", str(os.cpu_count())),
    ]
    if cuda:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        rows.append(("GPUs", f"{len(names)}: " + ", ".join(names)))
    return rows


def environment_rows(config_file: str | None = None) -> list[tuple[str, str]]:
    """(name, value) rows: versions, devices, the config file in use and its settings, the torch.compile
    settings the workers would get, launch variables set."""
    import fullshard

    rows = [
        ("fullshard", fullshard.__version__),
        ("Python", sys.version.split()[0]),
        ("Platform", platform.platform()),
        *_device_rows(),
        *((name, _version(name)) for name in ("transformers", "accelerate", "numpy", "safetensors")),
        *((name, _version(name)) for name in ("click", "PyYAML", "rich")),
        *_config_file_rows(config_file),
    ]
    try:
        cfg, _ = load_config(config_file)
    except ValueError as exc:
        return [*rows, ("Config error", str(exc))]
    settings: dict[str, Any] = cfg.to_dict()
    for section in ("fsdp_config", "dynamo_config"):
        for key, value in settings.pop(section, {}).items():
            settings[f"{section}.{key}"] = value
    rows += [(f"  {key}", str(value)) for key, value in settings.items()]
    rows.append(("Dynamo (torch.compile)", _dynamo_in_use(cfg)))
    rows += [(name, value) for name, value in env.set_variables().items()]
    return rows


def _dynamo_in_use(cfg: LaunchConfig) -> str:
    """What ``TorchDynamoPlugin()`` would resolve to in a worker of ``fullshard launch`` with ``cfg``: the config
    file's ``dynamo_config`` over the ``ACCELERATE_DYNAMO_*`` variables set here, over the plugin's defaults."""
    from fullshard.frontend.compile import TorchDynamoPlugin

    try:
        with env.patched(env.format_env(cfg.dynamo_config, env.DYNAMO_VARS)):
            plugin = TorchDynamoPlugin()
            from_env = set(env.read_dynamo_env())
    except ValueError as exc:
        return f"error: {exc}"
    sources = [name for name, fields in (("the config file", set(cfg.dynamo_config)),
                                         ("ACCELERATE_DYNAMO_* variables", from_env - set(cfg.dynamo_config)))
               if fields]  # fmt: skip
    origin = f" (from {' and '.join(sources)})" if sources else " (the default)"
    if not plugin.enabled:
        return f"backend no: the model is not compiled{origin}"
    settings = ", ".join(f"{key}={value}" for key, value in plugin.to_kwargs().items())
    return f"{settings}, use_regional_compilation={plugin.use_regional_compilation}{origin}"


def _config_file_rows(config_file: str | None) -> list[tuple[str, str]]:
    """Which config file `fullshard launch` reads (given or the default, found or not), and Accelerate's."""
    if config_file is not None:
        found = "found" if Path(config_file).is_file() else "not found"
        rows = [("Config file", f"{config_file} (given with --config_file; {found})")]
    else:
        default = default_config_path()
        used = "found, used" if default.is_file() else "not found, so launch uses its defaults: 1 process, no FSDP"
        rows = [("Config file", f"{default} (the default; {used})")]
    theirs = accelerate_default_config_path()
    if theirs.is_file():
        used = "used" if config_file and Path(config_file).resolve() == theirs.resolve() else "not used"
        state = f"exists, {used}" + ("" if used == "used" else f": pass --config_file {theirs} to use it")
    else:
        state = "none"
    return [*rows, ("Accelerate's default config", f"{theirs} ({state})")]


@click.command(
    "env",
    short_help="Print versions, devices and the configuration in use.",
    epilog="Example: fullshard env --config_file accelerate.yaml",
)
@click.option("--config_file", "--config-file", "config_file", default=None, metavar="FILE",
              help="Config file to show (default: the one fullshard launch reads, "
              "$FULLSHARD_HOME/default_config.yaml).")  # fmt: skip
def env_command(config_file: str | None) -> None:
    """Print, as a table to paste into a bug report: the versions of fullshard, Python, torch, transformers,
    accelerate, numpy and safetensors; the devices; the config file `fullshard launch` reads (and whether it
    exists), whether Accelerate's default config file exists and is used; its settings; the torch.compile settings
    the workers would get (the file's dynamo_config over the ACCELERATE_DYNAMO_* variables set); the FSDP_* and
    ACCELERATE_* variables set."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fullshard environment")
    table.add_column("Item", style="bold")
    table.add_column("Value", overflow="fold")
    for name, value in environment_rows(config_file):
        table.add_row(name, value)
    Console(width=max(100, Console().width)).print(table)

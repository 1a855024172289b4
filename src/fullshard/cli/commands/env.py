"""``fullshard env``: versions, devices and the configuration in use, as a table to paste into a bug report."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

import click

from fullshard.cli.config_file import load_config
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
    """(name, value) rows: versions, devices, the config file in use and its settings, launch variables set."""
    rows = [
        ("fullshard", _version("fullshard")),
        ("Python", sys.version.split()[0]),
        ("Platform", platform.platform()),
        *_device_rows(),
        *((name, _version(name)) for name in ("click", "PyYAML", "rich", "safetensors")),
    ]
    try:
        cfg, path = load_config(config_file)
    except ValueError as exc:
        return [*rows, ("Config file", f"error: {exc}")]
    rows.append(("Config file", str(path) if path else "none (defaults)"))
    settings: dict[str, Any] = cfg.to_dict()
    for key, value in settings.pop("fsdp_config", {}).items():
        settings[f"fsdp_config.{key}"] = value
    rows += [(f"  {key}", str(value)) for key, value in settings.items()]
    rows += [(name, value) for name, value in env.set_variables().items()]
    return rows


@click.command("env", short_help="Print versions, devices and the configuration in use.")
@click.option("--config_file", "--config-file", "config_file", default=None, help="Config file to show.")
def env_command(config_file: str | None) -> None:
    """Print versions, devices, the config file in use and the launch variables set, as a table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fullshard environment")
    table.add_column("Item", style="bold")
    table.add_column("Value", overflow="fold")
    for name, value in environment_rows(config_file):
        table.add_row(name, value)
    Console(width=max(100, Console().width)).print(table)

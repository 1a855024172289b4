"""``fullshard launch [--config_file F] [flags] script.py args…``: start the workers of a training script.

The config file (default: the one ``fullshard config`` wrote) gives the settings; flags override it. Every
``--fsdp_*`` flag comes from the table in :mod:`fullshard.frontend.env`, so the flags, the config keys and the
variables the workers read never disagree.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from fullshard.cli.config_file import RDZV_BACKENDS, load_config, override
from fullshard.cli.launch import build_launch, run_launch
from fullshard.frontend import env

__all__ = ["launch_command"]


def _parsed_by(var: env.EnvVar) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None:
            return None
        try:
            return var.parse(value, where=var.flag)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None

    return callback


def _table_options(table: tuple[env.EnvVar, ...]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """One ``--<config_key> VALUE`` option per table entry."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        for var in reversed(table):
            metavar = "|".join(var.choices) if var.choices else "VALUE"
            func = click.option(var.flag, var.config_key, callback=_parsed_by(var), metavar=metavar, help=var.help)(
                func
            )
        return func

    return decorate


def _opt(name: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An option spelled with underscores (Accelerate's) and with dashes."""
    spellings = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])
    return click.option(*spellings, name, **kwargs)


@click.command(
    "launch",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Start the worker processes of a training script.",
)
@_opt("config_file", type=click.Path(dir_okay=False), default=None, help="Config file (default: fullshard's).")
@_opt("num_processes", type=int, default=None, help="Worker processes in total, over all machines.")
@_opt("num_machines", type=int, default=None, help="Number of machines.")
@_opt("machine_rank", type=int, default=None, help="Rank of this machine (0 hosts the main process).")
@_opt("main_process_ip", default=None, help="Address of machine 0.")
@_opt("main_process_port", type=int, default=None, help="Port on machine 0 (default: a free one on 1 machine).")
@_opt("rdzv_backend", type=click.Choice(RDZV_BACKENDS), default=None, help="Rendezvous between machines.")
@_opt("max_restarts", type=int, default=None, help="Restarts of the workers after a failure.")
@_opt("mixed_precision", type=click.Choice(env.MIXED_PRECISION_CHOICES, case_sensitive=False), default=None)
@_opt("use_fsdp", is_flag=True, default=False, help="Shard the model with FSDP.")
@_opt("cpu", is_flag=True, default=False, help="Train on the CPU (gloo), even if an accelerator is present.")
@_opt("debug", is_flag=True, default=None, help="Check distributed operations for errors.")
@_opt("log_dir", type=click.Path(file_okay=False), default=None, help="Keep each rank's output in files here too.")
@_opt("shutdown_timeout", type=click.IntRange(min=0), default=None,
      help="Seconds between SIGTERM and SIGKILL when the workers are stopped (default 30).")  # fmt: skip
@click.option("-m", "--module", is_flag=True, default=False, help="Run the script as a module (python -m).")
@_table_options(env.FSDP_VARS)
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def launch_command(
    config_file: str | None,
    script: str,
    script_args: tuple[str, ...],
    module: bool,
    log_dir: str | None,
    shutdown_timeout: int | None,
    **flags: Any,
) -> None:
    """Run SCRIPT with its ARGS on every worker process, as torch's elastic launcher starts them."""
    try:
        cfg, _ = load_config(config_file)
        cfg = override(cfg, flags)
        plan = build_launch(cfg, script, script_args, module=module, log_dir=log_dir, shutdown_timeout=shutdown_timeout)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if not module and not Path(script).is_file():
        click.echo(f"fullshard launch: error: script {script!r} not found (no such file). Give its path.", err=True)
        sys.exit(2)
    missing = _missing_module(script) if module else None
    if missing:
        click.echo(f"fullshard launch: error: module {script!r} not found ({missing}). Give a module that "
                   "`python -m` finds from this folder or PYTHONPATH.", err=True)  # fmt: skip
        sys.exit(2)
    sys.exit(run_launch(plan))


def _missing_module(name: str) -> str | None:
    """Why the workers' ``python -m name`` would not find ``name`` (None if it would): looked up as they will,
    with this folder first on the path. A dotted name's parent packages are imported to look into them."""
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        return str(exc)
    finally:
        sys.path.pop(0)
    return None if spec is not None else f"No module named {name!r}"

"""``fullshard launch [--config_file F] [flags] script.py args…``: start the workers of a training script.

The config file (default: the one ``fullshard config`` wrote) gives the settings; flags override it. Every
``--fsdp_*`` and ``--dynamo_*`` flag comes from the tables in :mod:`fullshard.frontend.env`, so the flags, the
config keys and the variables the workers read never disagree. torchrun's spellings (``--nproc_per_node``, ``--nnodes``,
``--node_rank``, ``--master_addr``, ``--master_port``, ``--rdzv_*``) are accepted too: :func:`torchrun_spellings`
turns them into fullshard's, an elastic ``--nnodes MIN:MAX`` included. An option this command does not know is
reported as one, with the closest known spellings; only after SCRIPT is everything passed to the script as it is.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from fullshard.cli import as_accelerate as accelerate_redirect
from fullshard.cli.config_file import RDZV_BACKENDS, load_config, override
from fullshard.cli.launch_plan import build_launch, run_launch
from fullshard.frontend import env

__all__ = ["TORCHRUN_SPELLINGS", "launch_command", "parse_nnodes", "torchrun_spellings"]

TORCHRUN_SPELLINGS = {
    "node_rank": "machine_rank",
    "master_addr": "main_process_ip",
    "master_port": "main_process_port",
}
"""torchrun's option → the fullshard option that means the same (``--nnodes``, ``--nproc_per_node`` and
``--rdzv_endpoint`` need parsing or arithmetic, see :func:`torchrun_spellings`)."""


def parse_nnodes(value: str | int) -> tuple[int, int]:
    """torchrun's ``--nnodes``: ``N`` (exactly N machines) or ``MIN:MAX`` (an elastic range) → ``(MIN, MAX)``."""
    text = str(value).strip()
    low, sep, high = text.partition(":")
    try:
        pair = (int(low), int(high)) if sep else (int(text), int(text))
    except ValueError:
        pair = (0, 0)
    if not 1 <= pair[0] <= pair[1]:
        raise ValueError(
            f"--nnodes {value!r}: expected a number of machines (2) or an elastic range MIN:MAX with "
            "1 <= MIN <= MAX (1:2), as torchrun takes it."
        )
    return pair


def torchrun_spellings(flags: dict[str, Any], machines_in_file: int) -> dict[str, Any]:
    """``flags`` with torchrun's options (``None`` when not given) turned into fullshard's.

    ``nnodes`` ``N`` becomes ``num_machines``, and ``MIN:MAX`` ``min_machines`` and ``num_machines`` (the most);
    ``nproc_per_node`` (per machine) becomes ``num_processes`` (all machines: times ``--num_machines``, else
    ``--nnodes``'s most, else ``machines_in_file``); ``rdzv_endpoint`` ``HOST:PORT`` becomes ``main_process_ip``
    and ``main_process_port``. Raises ``ValueError`` when both spellings of one setting are given different values.
    """
    flags = dict(flags)
    given: dict[str, tuple[str, Any]] = {}  # fullshard key -> (the flag that gave it, value)

    def take(key: str, flag: str, value: Any) -> None:
        if value is None:
            return
        if key in given and given[key][1] != value:
            raise ValueError(
                f"{given[key][0]} {given[key][1]} and {flag} {value} set the same thing ({key}) to different "
                f"values. Give one of them."
            )
        given[key] = (flag, value)

    for key in ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port"):
        take(key, f"--{key}", flags.pop(key, None))
    nnodes = flags.pop("nnodes", None)
    if nnodes is not None:
        low, high = parse_nnodes(nnodes)
        take("num_machines", "--nnodes", high)
        if low != high:
            given["min_machines"] = ("--nnodes", low)
    for torchrun_key, key in TORCHRUN_SPELLINGS.items():
        take(key, f"--{torchrun_key}", flags.pop(torchrun_key, None))
    endpoint = flags.pop("rdzv_endpoint", None)
    if endpoint is not None:
        host, sep, port = str(endpoint).rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--rdzv_endpoint {endpoint!r}: expected HOST:PORT, e.g. 10.0.0.1:29500.")
        take("main_process_ip", "--rdzv_endpoint", host)
        take("main_process_port", "--rdzv_endpoint", int(port))
    per_node = flags.pop("nproc_per_node", None)
    if per_node is not None:
        machines = given.get("num_machines", ("", machines_in_file))[1]
        take("num_processes", f"--nproc_per_node {per_node} x {machines} machines =", per_node * machines)
    return {**flags, **{key: value for key, (_, value) in given.items()}}


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


def _dynamo_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--dynamo_backend``, ``--dynamo_mode`` and the on/off ``--dynamo_use_*`` flags of ``env.DYNAMO_VARS``, as
    ``accelerate launch`` has them; ``--no_dynamo_use_*`` turns off what the config file turns on."""
    for var in reversed(env.DYNAMO_VARS):
        if var.parse is env.parse_bool:
            help = f"{var.help.removesuffix(' (true/false).')} (torch.compile). --no_{var.config_key} sets false."
            func = click.option(f"{var.flag}/--no_{var.config_key}", var.config_key, default=None, help=help)(func)
        else:
            metavar = "|".join(var.choices) if var.field == "mode" else "NAME"
            func = click.option(var.flag, var.config_key, callback=_parsed_by(var), metavar=metavar, help=var.help)(
                func
            )
    return func


def _opt(name: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An option spelled with underscores (Accelerate's) and with dashes."""
    spellings = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])
    return click.option(*spellings, name, **kwargs)


def _torchrun_opt(name: str, meaning: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return _opt(name, default=None, help=f"torchrun's spelling: {meaning}", **kwargs)


@click.command(
    "launch",
    context_settings={"allow_interspersed_args": False},
    short_help="Start the worker processes of a training script.",
    epilog="Example: fullshard launch --num_processes 2 examples/train_gpt.py --steps 100",
)
@_opt("config_file", type=click.Path(dir_okay=False), default=None,
      help="Config file to read (default: the one `fullshard config` writes, "
      "$FULLSHARD_HOME/default_config.yaml, if it exists).")  # fmt: skip
@_opt("num_processes", type=int, default=None, help="Worker processes in total, over all machines (default 1).")
@_opt("num_machines", type=int, default=None, help="Number of machines (default 1).")
@_opt("machine_rank", type=int, default=None, help="Rank of this machine, 0 to num_machines - 1 (0 hosts the "
      "main process).")  # fmt: skip
@_opt("main_process_ip", default=None, help="Address of machine 0 (needed with several machines).")
@_opt("main_process_port", type=int, default=None, help="Port on machine 0 (default: a free one on 1 machine, "
      "29500 on several).")  # fmt: skip
@_opt(
    "rdzv_backend",
    type=click.Choice(RDZV_BACKENDS),
    default=None,
    help="How machines meet: static (fixed machine ranks, the default) or c10d (ranks in the order they join).",
)
@_torchrun_opt("nproc_per_node", "worker processes on each machine (num_processes / num_machines).", type=int)
@_torchrun_opt("nnodes", "--num_machines; or MIN:MAX, an elastic range of machines (with --rdzv_backend c10d).")
@_torchrun_opt("node_rank", "--machine_rank.", type=int)
@_torchrun_opt("master_addr", "--main_process_ip.")
@_torchrun_opt("master_port", "--main_process_port.", type=int)
@_torchrun_opt("rdzv_endpoint", "HOST:PORT, --main_process_ip HOST --main_process_port PORT.")
@_torchrun_opt("rdzv_id", "the job's id in the rendezvous (passed to torch's launcher).")
@_torchrun_opt("rdzv_conf", "KEY=VALUE,... rendezvous options (passed to torch's launcher), e.g. timeout=900.")
@_opt("max_restarts", type=int, default=None, help="Restarts of the workers after a failure (default 0).")
@_opt("mixed_precision", type=click.Choice(env.MIXED_PRECISION_CHOICES, case_sensitive=False), default=None,
      help="Compute in this precision (default no: float32).")  # fmt: skip
@_opt("use_fsdp", is_flag=True, default=False,
      help=f"Shard the model with FSDP (version {env.DEFAULT_FSDP_VERSION} unless --fsdp_version or the config "
      "file says otherwise, as in Accelerate).")  # fmt: skip
@_opt("cpu", is_flag=True, default=False, help="Train on the CPU (gloo), even if an accelerator is present.")
@_opt("debug", is_flag=True, default=None, help="Check distributed operations for errors.")
@_opt("log_dir", type=click.Path(file_okay=False), default=None, help="Keep each rank's output in files here too.")
@_opt("shutdown_timeout", type=click.IntRange(min=0), default=None,
      help="Seconds between SIGTERM and SIGKILL when the workers are stopped (default 30).")  # fmt: skip
@_opt("as_accelerate", is_flag=True, default=False,
      help="Serve `import accelerate` from fullshard in the script and its libraries (transformers' Trainer, ...): "
      "sets FULLSHARD_AS_ACCELERATE=1 for the workers.")  # fmt: skip
@click.option("-m", "--module", is_flag=True, default=False,
              help="SCRIPT is a module name, run as `python -m SCRIPT`.")  # fmt: skip
@_table_options(env.FSDP_VARS)
@_dynamo_options
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def launch_command(
    config_file: str | None,
    script: str,
    script_args: tuple[str, ...],
    module: bool,
    log_dir: str | None,
    shutdown_timeout: int | None,
    rdzv_id: str | None,
    rdzv_conf: str | None,
    as_accelerate: bool,
    **flags: Any,
) -> None:
    """Run SCRIPT (a Python file, or a module with -m) with SCRIPT_ARGS on every worker process.

    Options go before SCRIPT; everything after it is passed to the script unchanged. Without a config file
    and without flags, one process runs without FSDP; --use_fsdp without --fsdp_version uses FSDP version 1,
    as Accelerate does. Exit code: 0 when every worker succeeds, else the first failed worker's exit code
    (128 + N when killed by signal N); 2 for a usage error.
    """
    try:
        cfg, _ = load_config(config_file)
        cfg = override(cfg, torchrun_spellings(flags, cfg.num_machines))
        plan = build_launch(
            cfg,
            script,
            script_args,
            module=module,
            log_dir=log_dir,
            shutdown_timeout=shutdown_timeout,
            rdzv_id=rdzv_id,
            rdzv_conf=rdzv_conf,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    ignored = [f"--{name}" for name, value in flags.items() if name.startswith("fsdp_") and value is not None]
    if ignored and not cfg.use_fsdp:  # Accelerate ignores them silently; a run without the mode asked for is worse
        click.echo(f"fullshard launch: warning: {', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no "
                   "effect: FSDP is off in this launch. Add --use_fsdp (or distributed_type: FSDP in the config "
                   "file).", err=True)  # fmt: skip
    if as_accelerate:
        plan = dataclasses.replace(plan, env={**plan.env, accelerate_redirect.ENV_VAR: "1"})
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

"""The ``fullshard`` command: dispatches to the subcommands in :mod:`fullshard.cli.commands`."""

from __future__ import annotations

import sys

import click

from fullshard.cli.commands.config import config_command
from fullshard.cli.commands.env import env_command
from fullshard.cli.commands.estimate import estimate_command
from fullshard.cli.commands.launch import launch_command
from fullshard.cli.commands.merge import merge_command
from fullshard.cli.commands.verify import verify_command
from fullshard.cli.shutdown import exit_without_teardown

__all__ = ["cli", "main"]


_COMMANDS = (config_command, launch_command, env_command, merge_command, verify_command, estimate_command)


@click.group(
    "fullshard",
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Run `fullshard COMMAND --help` for a command's arguments; docs/cli.md describes them all.",
)
def cli() -> None:
    """fullshard: Fully Sharded Data Parallel training for PyTorch.

    \b
    fullshard config default                        write a basic config file
    fullshard launch --num_processes 2 train.py     start 2 workers of train.py
    fullshard env                                   versions and the config in use
    fullshard verify runs/x/checkpoints/checkpoint_3
    fullshard merge-weights runs/x/checkpoints/checkpoint_3/pytorch_model_fsdp_0 out/
    fullshard estimate-memory gpt2 --num_processes 8
    """


for _command in _COMMANDS:
    cli.add_command(_command)


def main() -> None:
    """Console entry point (``fullshard = "fullshard.cli.main:main"``). The process is the command's: it ends
    without the interpreter's teardown (see [Note: ending the launcher] in ``cli/shutdown.py``)."""
    try:
        cli(prog_name="fullshard")
        code: int = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # as the interpreter does with a non-integer exit code
            sys.stderr.write(f"{stop.code}\n")
            code = 1
    exit_without_teardown(code)


if __name__ == "__main__":
    main()

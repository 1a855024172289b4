"""The ``fullshard`` command: dispatches to the subcommands in :mod:`fullshard.cli.commands`."""

from __future__ import annotations

import click

from fullshard.cli.commands.config import config_command
from fullshard.cli.commands.env import env_command
from fullshard.cli.commands.estimate import estimate_command
from fullshard.cli.commands.launch import launch_command
from fullshard.cli.commands.merge import merge_command
from fullshard.cli.commands.verify import verify_command

__all__ = ["cli", "main"]


@click.group("fullshard", context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """fullshard: Fully Sharded Data Parallel training for PyTorch.

    Commands: config, launch, env, merge-weights, estimate-memory.
    """


for _command in (config_command, launch_command, env_command, merge_command, estimate_command, verify_command):
    cli.add_command(_command)


def main() -> None:
    """Console entry point (``fullshard = "fullshard.cli.main:main"``)."""
    cli(prog_name="fullshard")


if __name__ == "__main__":
    main()

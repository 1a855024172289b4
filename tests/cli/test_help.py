"""Help texts and docs/cli.md: every command listed, every argument said, no internal jargon."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from fullshard.cli.main import cli
from fullshard.frontend import env

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _commands(group: click.Group = cli, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    found = []
    for name, command in group.commands.items():
        found.append(((*prefix, name), command))
        if isinstance(command, click.Group):
            found += _commands(command, (*prefix, name))
    return found


def _help(*args: str) -> str:
    result = CliRunner().invoke(cli, [*args, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_the_top_help_names_every_command_in_its_text() -> None:
    text = _help().split("Options:")[0]
    for name in cli.commands:
        assert f"fullshard {name}" in text, name


@pytest.mark.parametrize(("path", "command"), _commands(), ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_every_option_says_what_it_is_without_jargon(path: tuple[str, ...], command: click.Command) -> None:
    for param in command.params:
        if isinstance(param, click.Option):
            assert param.help, f"fullshard {' '.join(path)} {param.opts[0]} has no help"
    text = _help(*path)
    assert "Example" in text, f"fullshard {' '.join(path)} --help shows no example"
    assert not re.search(r"\bseeds?\b", text, flags=re.IGNORECASE), text


def test_estimate_memory_help_says_what_model_may_be() -> None:
    text = " ".join(_help("estimate-memory").split())
    for form in ("package.module:factory", "config.json", "org/model", "architectures"):
        assert form in text


def test_the_launch_help_states_the_default_fsdp_version() -> None:
    text = " ".join(_help("launch").split())
    assert f"--use_fsdp without --fsdp_version uses FSDP version {env.DEFAULT_FSDP_VERSION}" in text


def test_docs_cli_md_covers_every_command_and_option() -> None:
    text = DOCS.read_text()
    for path, command in _commands():
        assert f"## `fullshard {' '.join(path)}`" in text, path
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "help":
                # An option's spelling, or its config key (the `fsdp_*` keys are also the flags).
                spelled = [form for opt in param.opts for form in (f"`{opt}", f"{opt} ", f"`{opt.lstrip('-')}`")]
                assert any(form in text for form in spelled), (path, param.opts)
    for var in (*env.FSDP_VARS, *env.DYNAMO_VARS):
        assert f"`{var.config_key}`" in text and f"`{var.env}`" in text
    for section in ("## Exit codes", "default_config.yaml", "package.module:factory"):
        assert section in text
    assert "docs/cli.md" in (DOCS.parents[1] / "README.md").read_text()

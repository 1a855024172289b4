"""``fullshard estimate-memory MODEL``: per-rank memory of sharded training, per strategy, as a table.

MODEL is ``package.module:factory`` (a class or function returning an ``nn.Module``, called without
arguments on the meta device, so nothing is allocated) or the path of a Hugging Face ``config.json`` (or its
folder), which needs ``transformers``. The numbers come from :mod:`fullshard.frontend.estimate`.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import click
import torch
from torch import nn

from fullshard.engine.api import ShardingStrategy
from fullshard.frontend.estimate import MemoryEstimate, estimate_memory, find_unit_classes, unit_parameters

__all__ = ["estimate_command", "load_model_spec"]

_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


def _from_factory(spec: str) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise click.BadParameter(
            f"{spec!r}: cannot import {attr!r} from {module_name!r} ({exc}). Give package.module:factory, e.g. "
            "fullshard.testing.models:TinyGPT, with the module importable from here."
        ) from None
    try:
        with torch.device("meta"):
            model = factory()
    except TypeError as exc:
        raise click.BadParameter(
            f"{spec!r}: calling {attr}() failed ({exc}). The factory must build the model without arguments; "
            "write a small function that returns it with the sizes you want."
        ) from None
    if not isinstance(model, nn.Module):
        raise click.BadParameter(f"{spec!r}: the factory returned a {type(model).__name__}, not an nn.Module.")
    return model


def _from_hf_config(path: Path) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise click.ClickException(
            f"MODEL={str(path)!r} is a Hugging Face config, which needs the transformers package: "
            "pip install transformers (or give a package.module:factory instead)."
        ) from None
    config = transformers.AutoConfig.from_pretrained(str(path.parent if path.is_file() else path))
    with torch.device("meta"):
        return transformers.AutoModel.from_config(config)


def load_model_spec(spec: str) -> nn.Module:
    """The model MODEL names, built on the meta device."""
    path = Path(spec)
    if path.name == "config.json" or (path.is_dir() and (path / "config.json").exists()):
        if not path.exists():
            raise click.BadParameter(f"{spec!r}: no such file. Give the path of a config.json or its folder.")
        return _from_hf_config(path)
    if ":" not in spec:
        raise click.BadParameter(
            f"{spec!r}: expected package.module:factory (e.g. fullshard.testing.models:TinyGPT) or a config.json path."
        )
    return _from_factory(spec)


def _human(nbytes: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (``12.3 KiB``)."""
    value, unit = float(nbytes), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_unit
    return f"{value:,.0f} B" if unit == "B" else f"{value:,.1f} {unit}"


def _table(estimates: list[MemoryEstimate], title: str) -> object:
    from rich.table import Table

    table = Table(title=title, caption="per rank (rank 0); total = on the device, activations not included")
    for column in ("strategy", "shard", "params", "grads", "Adam", "largest unit", "peak gathered", "total"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for e in estimates:
        where = " (CPU)" if e.cpu_offload else ""
        sizes = [_human(e.params) + where, _human(e.grads) + where, _human(e.optimizer) + where]
        sizes += [_human(e.largest_unit), _human(e.gathered), _human(e.device_total)]
        table.add_row(e.strategy.name.lstrip("_"), f"{e.shard_size}", *sizes)
    return table


@click.command("estimate-memory", short_help="Predict per-rank memory of sharded training for a model.")
@click.argument("model_spec", metavar="MODEL")
@click.option("--num_processes", "--num-processes", "num_processes", type=int, default=2, show_default=True)
@click.option("--num_machines", "--num-machines", "num_machines", type=int, default=1, show_default=True,
              help="Machines, for the hybrid strategies (shard within a machine).")  # fmt: skip
@click.option("--sharding_strategy", "--sharding-strategy", "strategies", multiple=True,
              type=click.Choice(_STRATEGIES, case_sensitive=False),
              help="Strategies to show, repeatable (default: all).")  # fmt: skip
@click.option("--mixed_precision", "--mixed-precision", "mixed_precision", default="no", show_default=True,
              type=click.Choice(("no", "bf16", "fp16")))  # fmt: skip
@click.option("--cpu_offload", "--cpu-offload", "cpu_offload", is_flag=True, help="Parameters and states on the CPU.")
@click.option("--transformer_layer_cls_to_wrap", "--wrap", "wrap", default=None,
              help="Comma-separated block classes that become units (default: _no_split_modules).")  # fmt: skip
def estimate_command(
    model_spec: str,
    num_processes: int,
    num_machines: int,
    strategies: tuple[str, ...],
    mixed_precision: str,
    cpu_offload: bool,
    wrap: str | None,
) -> None:
    """Print per-rank bytes for parameters, gradients, Adam states and gathered units of MODEL."""
    from rich.console import Console

    model = load_model_spec(model_spec)
    names = [n.strip() for n in wrap.split(",") if n.strip()] if wrap else None
    try:
        units = unit_parameters(model, find_unit_classes(model, names))
        options = {"mixed_precision": mixed_precision, "cpu_offload": cpu_offload, "num_machines": num_machines}
        estimates = [estimate_memory(units, num_processes, _strategy(s), **options) for s in strategies or _STRATEGIES]
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    count = sum(p.numel() for unit in units for p in unit)
    title = f"{type(model).__name__}: {count:,} parameters in {len(units)} units, {num_processes} processes"
    Console().print(_table(estimates, title))


def _strategy(name: str) -> ShardingStrategy:
    name = name.upper()
    return ShardingStrategy["_HYBRID_SHARD_ZERO2" if name == "HYBRID_SHARD_ZERO2" else name]

"""``fullshard estimate-memory MODEL``: peak memory per rank of sharded training, per strategy and world size.

MODEL, built on the meta device so that nothing is allocated, is one of:
- ``package.module:factory``: a class or function returning an ``nn.Module``, called with the keyword
  arguments of ``--model-arg KEY=VALUE`` (repeatable; values are JSON, else strings) and of
  ``--model-config FILE.json`` (an object), e.g. ``fullshard.testing.models:gpt --model-arg n_layer=16``;
- the path of a Hugging Face ``config.json`` or its folder, or a Hub model name (``org/name``, which needs
  the network, as Accelerate's ``estimate-memory`` does); both need ``transformers``. The model is the class
  the config's ``architectures`` names (``LlamaForCausalLM``, with its LM head), else ``AutoModel``'s.

The hybrid strategies are shown only with ``--num_machines`` above 1 (on one machine they are FULL_SHARD and
SHARD_GRAD_OP), unless ``--sharding_strategy`` asks for them.

The figures come from :mod:`fullshard.cli.memory_estimate` (state, gathered units, gradient buffer, process
baseline) and :mod:`fullshard.cli.activations` (one meta forward of ``--batch-size`` x ``--seq-len``
tokens). ``--budget`` adds a column saying which rows fit that many bytes per rank. The table keeps every
strategy name whole in an 80-column terminal: all sizes share one unit, named in the caption.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import click
import torch
from torch import nn

from fullshard.cli.memory_estimate import (
    PROCESS_BASELINE,
    MemoryEstimate,
    estimate_memory,
    find_unit_classes,
    profile_training,
)
from fullshard.engine import ShardingStrategy

__all__ = ["estimate_command", "load_model_spec"]

_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


def _size(text: str, option: str) -> int:
    """``--budget`` / ``--baseline``: ``8GiB``, ``7.5 GB``, ``512MiB`` or a byte count (``checkpoint.parse_size``)."""
    from fullshard.checkpoint import parse_size  # here: its module imports torch's DCP, `fullshard launch` needn't

    try:
        return parse_size(text, arg=option, minimum=0)
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected a size such as 8GiB, 7.5GB or 512MiB.") from None


def _factory_kwargs(model_args: tuple[str, ...], model_config: Path | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if model_config is not None:
        loaded = json.loads(model_config.read_text())
        if not isinstance(loaded, dict):
            raise click.BadParameter(f"{str(model_config)!r}: expected a JSON object of keyword arguments.")
        kwargs.update(loaded)
    for item in model_args:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise click.BadParameter(f"--model-arg {item!r}: expected KEY=VALUE, e.g. n_layer=16.")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return kwargs


def _from_factory(spec: str, kwargs: dict[str, Any]) -> nn.Module:
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
            model = factory(**kwargs)
    except TypeError as exc:
        given = f" with {kwargs}" if kwargs else " without arguments"
        raise click.BadParameter(
            f"{spec!r}: calling {attr}(){given} failed ({exc}). Pass the factory's keyword arguments with "
            "--model-arg KEY=VALUE, or write a small function that returns the model with the sizes you want."
        ) from None
    if not isinstance(model, nn.Module):
        raise click.BadParameter(f"{spec!r}: the factory returned a {type(model).__name__}, not an nn.Module.")
    return model


class _CannotRun(click.ClickException):
    """What is missing to run at all (a package): a usage error, exit 2, as a bad argument."""

    exit_code = 2


def _from_hf(name_or_path: str) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise _CannotRun(
            f"MODEL={name_or_path!r} is a Hugging Face config, which needs the transformers package: "
            "pip install transformers (or give a package.module:factory instead)."
        ) from None
    try:
        config = transformers.AutoConfig.from_pretrained(name_or_path)
    except OSError as exc:
        raise click.ClickException(
            f"MODEL={name_or_path!r}: no Hugging Face config found ({str(exc).splitlines()[0]}). Give a local "
            "config.json or its folder, a Hub name reachable from here, or package.module:factory."
        ) from None
    with torch.device("meta"):
        return _model_class(transformers, config)(config)


def _model_class(transformers: Any, config: Any) -> Any:
    """The class ``config.json`` names in ``architectures`` (``LlamaForCausalLM``: the model with its LM head,
    which the training script trains), else the base model ``AutoModel`` builds for this config."""
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls
    return lambda config: transformers.AutoModel.from_config(config)


def load_model_spec(spec: str, kwargs: dict[str, Any] | None = None) -> nn.Module:
    """The model MODEL names, built on the meta device."""
    path = Path(spec)
    if path.name == "config.json" or (path.is_dir() and (path / "config.json").exists()):
        if not path.exists():
            raise click.BadParameter(f"{spec!r}: no such file. Give the path of a config.json or its folder.")
        return _from_hf(str(path.parent if path.is_file() else path))
    if ":" in spec:
        return _from_factory(spec, kwargs or {})
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec) and not path.exists():
        return _from_hf(spec)
    raise click.BadParameter(
        f"{spec!r}: expected package.module:factory (e.g. fullshard.testing.models:TinyGPT), a config.json path "
        "or a Hugging Face Hub name such as org/model."
    )


def _scale(estimates: list[MemoryEstimate]) -> tuple[int, str]:
    largest = max((e.peak for e in estimates), default=0)
    return (2**30, "GiB") if largest >= 2**30 else (2**20, "MiB")


def _table(estimates: list[MemoryEstimate], title: str, budget: int | None) -> Any:
    from rich import box
    from rich.table import Table

    scale, unit = _scale(estimates)
    caption = (
        f"{unit} per rank. state = params + grads + Adam; gath. = gathered units (peak); act. = activations; "
        f"buf = a unit's full gradient x2; at = backward's start or end; peak adds the process baseline "
        f"({estimates[0].baseline / 2**30:.2f} GiB)"
        + ("; c = kept on the CPU, not in peak" if any(e.cpu_offload for e in estimates) else "")
    )
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("strategy", no_wrap=True)
    for column in ("N", "state", "gath.", "act.", "buf", "peak", "at"):
        table.add_column(column, justify="right" if column != "at" else "left", no_wrap=True)
    if budget is not None:
        table.add_column("fits", no_wrap=True)
    for e in estimates:
        state = (e.params + e.grads + e.optimizer) / scale
        sizes = [f"{state:.2f}" + ("c" if e.cpu_offload else "")]
        sizes += [f"{v / scale:.2f}" for v in (e.gathered, e.activations, e.grad_buffer, e.peak)]
        row = [e.strategy.name.lstrip("_"), str(e.num_processes), *sizes, e.peak_phase.replace("backward ", "")]
        if budget is not None:
            row.append("yes" if e.peak <= budget else "no")
        table.add_row(*row)
    return table


def _num_processes(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise click.BadParameter(f"{text!r}: expected process counts such as 2 or 1,2,4.")
    return counts


def _default_seq(model: nn.Module) -> int:
    config = getattr(model, "config", None) or getattr(model, "cfg", None)
    for name in ("block_size", "n_positions", "max_position_embeddings", "seq_length"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    raise click.UsageError(f"{type(model).__name__} names no sequence length in its config: pass --seq-len.")


@click.command(
    "estimate-memory",
    short_help="Predict per-rank peak memory of sharded training for a model.",
    epilog="Examples: fullshard estimate-memory fullshard.testing.models:gpt --model-arg n_layer=16 --wrap Block; "
    "fullshard estimate-memory path/to/model_folder --num_processes 2,4,8 --budget 24GiB; "
    "fullshard estimate-memory meta-llama/Llama-3.2-1B --num_machines 2 --num_processes 16",
)
@click.argument("model_spec", metavar="MODEL")
@click.option("--model-arg", "--model_arg", "model_args", multiple=True, metavar="KEY=VALUE",
              help="Keyword argument of the factory (repeatable), e.g. n_layer=16.")  # fmt: skip
@click.option("--model-config", "--model_config", "model_config", type=click.Path(exists=True, path_type=Path),
              help="JSON object of keyword arguments for the factory.")  # fmt: skip
@click.option("--num_processes", "--num-processes", "num_processes", default="2", show_default=True,
              help="Processes (world size); several as 1,2,4.")  # fmt: skip
@click.option("--num_machines", "--num-machines", "num_machines", type=int, default=1, show_default=True,
              help="Machines; above 1 adds the hybrid strategies (shard within a machine).")  # fmt: skip
@click.option("--sharding_strategy", "--sharding-strategy", "strategies", multiple=True,
              type=click.Choice(_STRATEGIES, case_sensitive=False),
              help="Strategies to show, repeatable (default: all; hybrid ones if --num_machines > 1).")  # fmt: skip
@click.option("--batch-size", "--batch_size", "batch", type=int, default=1, show_default=True,
              help="Sequences per rank per step.")  # fmt: skip
@click.option("--seq-len", "--seq_len", "seq", type=int, default=None,
              help="Tokens per sequence (default: the config's block_size / max_position_embeddings).")  # fmt: skip
@click.option("--activation-checkpointing", "--activation_checkpointing", "checkpointing", is_flag=True,
              help="Every unit recomputes its forward in backward.")  # fmt: skip
@click.option("--no-prefetch", "--no_prefetch", "no_prefetch", is_flag=True,
              help="One gathered unit at a time (backward_prefetch=None) instead of two.")  # fmt: skip
@click.option("--mixed_precision", "--mixed-precision", "mixed_precision", default="no", show_default=True,
              type=click.Choice(("no", "bf16", "fp16")), help="Compute precision of the gathered units.")  # fmt: skip
@click.option("--cpu_offload", "--cpu-offload", "cpu_offload", is_flag=True, help="Parameters and states on the CPU.")
@click.option("--transformer_layer_cls_to_wrap", "--wrap", "wrap", default=None,
              help="Comma-separated block classes that become units (default: _no_split_modules).")  # fmt: skip
@click.option("--budget", default=None, metavar="SIZE", help="Per-rank memory to fit, e.g. 8GiB: says which fit.")
@click.option("--baseline", default=None, metavar="SIZE",
              help=f"Process RSS besides tensors (default {PROCESS_BASELINE >> 20}MiB, measured on CPU).")  # fmt: skip
def estimate_command(
    model_spec: str,
    model_args: tuple[str, ...],
    model_config: Path | None,
    num_processes: str,
    num_machines: int,
    strategies: tuple[str, ...],
    batch: int,
    seq: int | None,
    checkpointing: bool,
    no_prefetch: bool,
    mixed_precision: str,
    cpu_offload: bool,
    wrap: str | None,
    budget: str | None,
    baseline: str | None,
) -> None:
    """Print per-rank peak memory of training MODEL: state, gathered units, activations, baseline.

    MODEL is one of: package.module:factory, a class or function returning the nn.Module (keyword arguments
    from --model-arg / --model-config); the path of a Hugging Face config.json or of the folder holding it; or a
    Hugging Face Hub name such as org/model (needs the network). The last two need transformers and build the
    class named in config.json's "architectures" (e.g. LlamaForCausalLM, LM head included), else AutoModel's.
    Nothing is allocated: the model is built on the meta device.
    """
    from rich.console import Console

    budget_bytes = _size(budget, "--budget") if budget is not None else None
    baseline_bytes = _size(baseline, "--baseline") if baseline is not None else PROCESS_BASELINE
    counts = _num_processes(num_processes)
    model = load_model_spec(model_spec, _factory_kwargs(model_args, model_config))
    seq = seq if seq is not None else _default_seq(model)
    names = [n.strip() for n in wrap.split(",") if n.strip()] if wrap else None
    options = {"mixed_precision": mixed_precision, "cpu_offload": cpu_offload, "num_machines": num_machines}
    try:
        classes = find_unit_classes(model, names)
        units, profile = profile_training(model, classes, batch=batch, seq=seq)  # once: it runs a meta forward
        estimates = [
            estimate_memory(units, n, _strategy(s), activations=profile, checkpointing=checkpointing,
                            baseline=baseline_bytes, units_in_flight=1 if no_prefetch else 2, **options)
            for n in counts for s in strategies or _default_strategies(num_machines)
        ]  # fmt: skip
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    count = sum(p.numel() for p in model.parameters())
    units = sum(1 for m in model.modules() if type(m) in classes) + 1
    title = f"{type(model).__name__}: {count:,} parameters in {units} units; {batch} x {seq} tokens per rank" + (
        ", activation checkpointing" if checkpointing else ""
    )
    console = Console()
    console.print(_table(estimates, title, budget_bytes))
    if budget_bytes is not None:
        fitting = [f"{e.strategy.name.lstrip('_')} on {e.num_processes}" for e in estimates if e.peak <= budget_bytes]
        console.print(
            f"Fits {budget} per rank: {', '.join(fitting)}."
            if fitting
            else f"Nothing fits {budget} per rank: "
            "add processes, --activation-checkpointing, a smaller --batch-size, or --cpu_offload (on GPUs)."
        )


def _default_strategies(num_machines: int) -> tuple[str, ...]:
    """Every strategy; the hybrid ones (shard within a machine, replicate across) only with several machines,
    where they differ from FULL_SHARD and SHARD_GRAD_OP."""
    return _STRATEGIES if num_machines > 1 else tuple(s for s in _STRATEGIES if not s.startswith("HYBRID"))


def _strategy(name: str) -> ShardingStrategy:
    name = name.upper()
    return ShardingStrategy["_HYBRID_SHARD_ZERO2" if name == "HYBRID_SHARD_ZERO2" else name]

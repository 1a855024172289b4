"""``fullshard config``: ask Accelerate's questions and write the config file; ``config default``: a basic one.

Every question is also an option (``--num_processes 2``, ``--fsdp_version 2``, ...): a question whose option
was given is not asked, and ``--non_interactive`` takes the default answer for the rest, so scripts can write
a config file without a terminal. The FSDP and torch dynamo questions use the parsers and config keys of the
tables in :mod:`fullshard.frontend.env`; an answered ``--dynamo_*`` option implies yes to the dynamo questions
that lead to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from fullshard.cli.config_file import RDZV_BACKENDS, LaunchConfig, default_config_path, save_config
from fullshard.frontend import env

__all__ = ["QUESTIONS", "Question", "ask", "config_command", "config_from_answers", "default_config"]

Answers = dict[str, Any]


@dataclass(frozen=True)
class Question:
    """One question of ``fullshard config``."""

    key: str
    """Answer key: a LaunchConfig field, an ``fsdp_*`` config key, or a helper (``use_no_split_modules``)."""
    text: str
    """The question."""
    parse: Callable[..., Any]
    """``parse(text, where=...)`` → answer; ``ValueError`` makes the prompt ask again."""
    default: Any = None
    """Default answer, or a function of the answers so far."""
    when: Callable[[Answers], bool] = lambda answers: True
    """Whether to ask, given the answers so far."""
    choices: tuple[str, ...] = ()
    """Shown after the question."""
    prompted: bool = True
    """``False`` for fullshard's own settings, which Accelerate does not ask about: only their option answers
    them, and without it nothing is written (so the questions and their order stay Accelerate's)."""

    def default_for(self, answers: Answers) -> Any:
        return self.default(answers) if callable(self.default) else self.default


def _text(value: object, *, where: str = "value") -> str:
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ValueError(f"{where}={value!r}: expected a non-empty answer.")


def _choice(choices: tuple[str, ...]) -> Callable[..., str]:
    def parse(value: object, *, where: str = "value") -> str:
        if str(value).strip().lower() in choices:
            return str(value).strip().lower()
        raise ValueError(f"{where}={value!r}: not a valid choice. Use one of {', '.join(choices)}.")

    return parse


def _table(
    key: str,
    text: str,
    default: Any,
    when: Callable[[Answers], bool],
    table: tuple[env.EnvVar, ...] = env.FSDP_VARS,
    **kw: Any,
) -> Question:
    var = env.by_config_key(key, table)
    if var is None:
        raise AssertionError(f"no env table entry for {key}")
    return Question(key, text, var.parse, default, when, kw.get("choices", var.choices), kw.get("prompted", True))


def _fsdp(a: Answers) -> bool:
    return bool(a.get("use_fsdp"))


def _v1(a: Answers) -> bool:
    return _fsdp(a) and a.get("fsdp_version") == 1


def _v2(a: Answers) -> bool:
    return _fsdp(a) and a.get("fsdp_version") == 2


def _dynamo(a: Answers) -> bool:
    return bool(a.get("use_dynamo"))


def _custom_dynamo(a: Answers) -> bool:
    return _dynamo(a) and bool(a.get("customize_dynamo"))


_DYNAMO_KEYS = tuple(var.config_key for var in env.DYNAMO_VARS)
"""dynamo_backend first, then the settings behind "Do you want to customize the defaults sent to torch.compile?"."""


def _multi(a: Answers) -> bool:
    return a.get("num_machines", 1) > 1


def _wrap(policy: str) -> Callable[[Answers], bool]:
    return lambda a: _fsdp(a) and a.get("fsdp_auto_wrap_policy") == policy


def _accelerator_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


QUESTIONS: tuple[Question, ...] = (
    Question("use_cpu", "Do you want to train on the CPU only (gloo)?", env.parse_bool,
             lambda a: _accelerator_count() == 0),
    Question("num_machines", "How many different machines will you use (use more than 1 for multi-node training)?",
             env.parse_int, 1),
    Question("machine_rank", "What is the rank of this machine?", env.parse_int, 0, _multi),
    Question("main_process_ip", "What is the IP address of the machine that will host the main process?", _text,
             None, _multi),
    Question("main_process_port", "What is the port you will use to communicate with the main process?",
             env.parse_int, 29500, _multi),
    Question("rdzv_backend", "What rendezvous backend will you use?", _choice(RDZV_BACKENDS), "static", _multi,
             RDZV_BACKENDS),
    Question("use_dynamo", "Do you wish to optimize your script with torch dynamo?", env.parse_bool, False),
    _table("dynamo_backend", "Which dynamo backend would you like to use?", "inductor", _dynamo, env.DYNAMO_VARS,
           choices=env.DYNAMO_BACKENDS[1:]),
    Question("customize_dynamo", "Do you want to customize the defaults sent to torch.compile?", env.parse_bool,
             False, _dynamo),
    _table("dynamo_mode", "Which mode do you want to use?", "default", _custom_dynamo, env.DYNAMO_VARS),
    _table("dynamo_use_fullgraph",
           "Do you want the fullgraph mode or it is ok to break model into several subgraphs?", False, _custom_dynamo,
           env.DYNAMO_VARS),
    _table("dynamo_use_dynamic", "Do you want to enable dynamic shape tracing?", False, _custom_dynamo,
           env.DYNAMO_VARS),
    _table("dynamo_use_regional_compilation", "Do you want to enable regional compilation?", False, _custom_dynamo,
           env.DYNAMO_VARS),
    Question("use_fsdp", "Do you want to use FullyShardedDataParallel?", env.parse_bool, True),
    _table("fsdp_version", "What should be your FSDP version?", env.DEFAULT_FSDP_VERSION, _fsdp, choices=("1", "2")),
    _table("fsdp_reshard_after_forward", "What should be your sharding strategy?", "FULL_SHARD", _v1,
           choices=env.SHARDING_STRATEGY_CHOICES),
    _table("fsdp_reshard_after_forward", "Do you want to enable resharding after forward?", True, _v2, choices=()),
    _table("fsdp_offload_params", "Do you want to offload parameters and gradients to CPU?", False, _fsdp),
    _table("fsdp_auto_wrap_policy", "What should be your auto wrap policy?", "TRANSFORMER_BASED_WRAP", _fsdp),
    Question("use_no_split_modules",
             "Do you want to use the model's `_no_split_modules` to wrap (Transformers models only)?",
             env.parse_bool, False, _wrap("TRANSFORMER_BASED_WRAP")),
    _table("fsdp_transformer_layer_cls_to_wrap",
           "Specify the comma-separated list of transformer layer class names (case-sensitive) to wrap, "
           "e.g. BertLayer, GPTJBlock, T5Block",
           None, lambda a: _wrap("TRANSFORMER_BASED_WRAP")(a) and not a.get("use_no_split_modules")),
    _table("fsdp_min_num_params", "What should be your FSDP's minimum number of parameters for size-based wrapping?",
           100_000_000, _wrap("SIZE_BASED_WRAP")),
    _table("fsdp_backward_prefetch", "What should be your FSDP's backward prefetch policy?", "BACKWARD_PRE", _v1),
    _table("fsdp_state_dict_type", "What should be your FSDP's state dict type?",
           lambda a: "FULL_STATE_DICT" if a.get("fsdp_version") == 1 else "SHARDED_STATE_DICT", _fsdp),
    _table("fsdp_forward_prefetch", "Do you want to enable FSDP's forward prefetch policy?", False, _v1),
    _table("fsdp_use_orig_params", "Do you want to enable FSDP's `use_orig_params` feature?", True, _v1),
    _table("fsdp_cpu_ram_efficient_loading",
           "Do you want to enable CPU RAM efficient model loading? Only applicable for Transformers models.", True,
           _fsdp),
    _table("fsdp_sync_module_states",
           "Do you want each individually wrapped FSDP unit to broadcast module parameters from rank 0 at the start?",
           True, lambda a: _v1(a) and not a.get("fsdp_cpu_ram_efficient_loading")),
    _table("fsdp_activation_checkpointing", "Do you want to enable FSDP activation checkpointing?", False, _fsdp),
    _table("fsdp_invariant_micro_batches",
           "How many micro-batches G per step for world-size-invariant training (a power of two; 0: off)?", None,
           _fsdp, prompted=False),
    _table("fsdp_whole_param_step",
           "Step matrix optimizers (Muon, Adafactor) on whole parameters, one owning rank each?", None, _fsdp,
           prompted=False),
    Question("num_processes", "How many processes should be used for distributed training (all machines together)?",
             env.parse_int, lambda a: a["num_machines"] * (1 if a.get("use_cpu") else max(1, _accelerator_count()))),
    Question("mixed_precision", "Do you wish to use mixed precision?",
             env.by_field("mixed_precision", env.LAUNCH_VARS).parse, "no", choices=env.MIXED_PRECISION_CHOICES),
)  # fmt: skip


def ask(given: Answers, *, interactive: bool = True) -> Answers:
    """Answer every question that applies: from ``given``, else by prompting, else (not interactive) the default."""
    given = _implied(given)
    answers: Answers = {}
    for question in QUESTIONS:
        if not question.when(answers):
            continue
        if given.get(question.key) is not None:
            answers[question.key] = question.parse(given[question.key], where=f"--{question.key}")
        elif not question.prompted:
            continue
        elif interactive:
            answers[question.key] = _prompt(question, answers)
        else:
            answers[question.key] = question.default_for(answers)
    return answers


def _implied(given: Answers) -> Answers:
    """``given`` with yes to the dynamo questions that lead to a ``--dynamo_*`` option given (else it would not
    be asked, and the option would be dropped)."""
    given = dict(given)
    for helper, keys in (("use_dynamo", _DYNAMO_KEYS), ("customize_dynamo", _DYNAMO_KEYS[1:])):
        if given.get(helper) is None and any(given.get(key) is not None for key in keys):
            given[helper] = True
    return given


def _prompt(question: Question, answers: Answers) -> Any:
    def value_proc(text: str) -> Any:
        try:
            return question.parse(text, where="answer")
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None

    suffix = f" ({', '.join(question.choices)})" if question.choices else ""
    default = question.default_for(answers)
    shown = None if default is None else (str(default).lower() if isinstance(default, bool) else str(default))
    return click.prompt(question.text + suffix, default=shown, value_proc=value_proc)


def config_from_answers(answers: Answers) -> LaunchConfig:
    """The config file that the answers describe, with the keys Accelerate's ``accelerate config`` writes."""
    fsdp = {k: v for k, v in answers.items() if k.startswith("fsdp_") and v is not None}
    if fsdp.get("fsdp_version") == 1 and fsdp.get("fsdp_cpu_ram_efficient_loading"):
        fsdp["fsdp_sync_module_states"] = True
    processes = answers["num_processes"]
    plain = "NO" if processes == 1 else ("MULTI_CPU" if answers["use_cpu"] else "MULTI_GPU")
    rdzv_backend = answers.get("rdzv_backend", "static")
    return LaunchConfig(
        distributed_type="FSDP" if answers["use_fsdp"] else plain,
        mixed_precision=answers["mixed_precision"],
        use_cpu=answers["use_cpu"],
        num_processes=processes,
        num_machines=answers["num_machines"],
        machine_rank=answers.get("machine_rank", 0),
        main_process_ip=answers.get("main_process_ip"),
        main_process_port=answers.get("main_process_port"),
        rdzv_backend=rdzv_backend,
        fsdp_config=fsdp if answers["use_fsdp"] else {},
        dynamo_config={k: answers[k] for k in _DYNAMO_KEYS if answers.get(k) is not None} if _dynamo(answers) else {},
        extra={
            "downcast_bf16": "no",
            "main_training_function": "main",
            "same_network": rdzv_backend == "static",
            "tpu_env": [],
            "tpu_use_cluster": False,
            "tpu_use_sudo": False,
        },
    )


def default_config(mixed_precision: str = "no") -> LaunchConfig:
    """A basic config: FSDP (version :data:`env.DEFAULT_FSDP_VERSION`, as ``fullshard launch --use_fsdp`` and
    Accelerate use when none is given) over every accelerator of this machine, or one CPU process if it has none.

    No auto wrap and no RAM-efficient loading: both depend on the model, so the basic file works with any. No
    ``dynamo_config`` (as Accelerate's basic config): the model is not compiled.
    """
    given = {"use_fsdp": True, "mixed_precision": mixed_precision}
    given |= {"fsdp_auto_wrap_policy": "NO_WRAP", "fsdp_cpu_ram_efficient_loading": False}
    answers = ask(given, interactive=False)
    return config_from_answers(answers)


def _question_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """One ``--<key> VALUE`` option per question: its answer, so that the question is not asked."""
    seen: set[str] = set()
    for question in reversed(QUESTIONS):
        if question.key in seen:
            continue
        seen.add(question.key)
        answer = f"The answer to: {question.text}"
        metavar = "|".join(question.choices) if question.choices else _METAVARS.get(question.parse, "TEXT")
        func = click.option(f"--{question.key}", question.key, default=None, metavar=metavar, help=answer)(func)
    return func


_METAVARS: dict[Callable[..., Any], str] = {env.parse_bool: "true|false", env.parse_int: "INTEGER"}


def _target(config_file: str | None) -> Path:
    return Path(config_file) if config_file else default_config_path()


@click.group(
    "config",
    invoke_without_command=True,
    short_help="Write a config file for fullshard launch.",
    epilog="Example: fullshard config --non_interactive --num_processes 2 --use_cpu true --fsdp_version 2",
)
@click.option("--config_file", "--config-file", "config_file", default=None, metavar="FILE",
              help="Where to write it (default: $FULLSHARD_HOME/default_config.yaml, "
              "~/.cache/fullshard/default_config.yaml unless set).")  # fmt: skip
@click.option("--non_interactive", "--non-interactive", "non_interactive", is_flag=True,
              help="Ask nothing: the questions not answered by an option take their default answer.")  # fmt: skip
@_question_options
@click.pass_context
def config_command(ctx: click.Context, config_file: str | None, non_interactive: bool, **given: Any) -> None:
    """Ask Accelerate's questions and write the answers as a YAML config file that `fullshard launch` and
    `accelerate launch` both read. Every question can be answered by its option instead."""
    if ctx.invoked_subcommand is not None:
        return
    try:
        cfg = config_from_answers(ask(given, interactive=not non_interactive))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    path = save_config(cfg, _target(config_file))
    click.echo(f"fullshard configuration saved at {path}")


@config_command.command(
    "default",
    short_help="Write a basic config file without questions.",
    epilog="Example: fullshard config default --mixed_precision bf16",
)
@click.option("--config_file", "--config-file", "config_file", default=None, metavar="FILE",
              help="Where to write it (default: $FULLSHARD_HOME/default_config.yaml).")  # fmt: skip
@click.option(
    "--mixed_precision",
    "--mixed-precision",
    "mixed_precision",
    type=click.Choice(env.MIXED_PRECISION_CHOICES, case_sensitive=False),
    default="no",
    show_default=True,
    help="Compute precision the file sets.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing file.")
def default_command(config_file: str | None, mixed_precision: str, overwrite: bool) -> None:
    """Write a basic config file: FSDP version 1 (the default of fullshard launch and of Accelerate), no auto
    wrap, over every accelerator of this machine, or one CPU process if it has none."""
    path = _target(config_file)
    if path.exists() and not overwrite:
        raise click.ClickException(
            f"configuration already exists at {path}; pass --overwrite to replace it, or --config_file elsewhere."
        )
    save_config(default_config(mixed_precision.lower()), path)
    click.echo(f"fullshard configuration saved at {path}")

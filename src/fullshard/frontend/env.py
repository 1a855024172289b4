"""The one table of launcher environment variables: plugin field ↔ variable ↔ config key ↔ launch flag.

``fullshard launch`` (and ``accelerate launch``) pass the FSDP settings of a config file to the worker
processes as ``FSDP_*`` environment variables; :class:`~fullshard.frontend.plugin.FullyShardedDataParallelPlugin`
reads them back for every field the user did not pass explicitly. Both sides use :data:`FSDP_VARS`, so a
setting is named once: its plugin field, its variable, its key in the YAML ``fsdp_config`` section (which is
also the ``fullshard launch --<key>`` flag) and how its value is parsed and written.

The names are Accelerate 1.15's (``accelerate/utils/launch.py``, ``commands/launch.py``,
``utils/dataclasses.py``), so an Accelerate config file and an environment set by ``accelerate launch``
work unchanged. :data:`LAUNCH_VARS` holds the few ``ACCELERATE_*`` variables the launcher also sets;
:data:`PARALLELISM_VARS` the ``PARALLELISM_CONFIG_*`` ones of the config file's ``parallelism_config`` section,
which :class:`~fullshard.frontend.parallelism.ParallelismConfig` reads back.

This is the only module of the package that reads or writes an ``FSDP_*`` variable.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from fullshard.engine import BackwardPrefetch, ShardingStrategy, StateDictType
from fullshard.frontend.enums import DynamoBackend

__all__ = [
    "AUTO_WRAP_POLICIES",
    "BACKWARD_PREFETCH_CHOICES",
    "DEFAULT_FSDP_VERSION",
    "DYNAMO_BACKENDS",
    "DYNAMO_MODES",
    "DYNAMO_VARS",
    "FSDP_VARS",
    "LAUNCH_VARS",
    "MIXED_PRECISION_CHOICES",
    "PARALLELISM_VARS",
    "SHARDING_STRATEGY_CHOICES",
    "STATE_DICT_TYPE_CHOICES",
    "EnvVar",
    "by_config_key",
    "by_field",
    "format_env",
    "is_bool_text",
    "parse_bool",
    "parse_int",
    "patched",
    "set_variables",
    "read_env",
    "read_dynamo_env",
    "read_launch_env",
    "read_parallelism_env",
    "write_field",
]

_TRUE = ("true", "1", "yes", "y", "on")
_FALSE = ("false", "0", "no", "n", "off")

# Accelerate writes HYBRID_SHARD_ZERO2 where torch's member is _HYBRID_SHARD_ZERO2; choice i+1 is value i+1.
SHARDING_STRATEGY_CHOICES: tuple[str, ...] = tuple(m.name.lstrip("_") for m in ShardingStrategy)
BACKWARD_PREFETCH_CHOICES: tuple[str, ...] = (*(m.name for m in BackwardPrefetch), "NO_PREFETCH")
STATE_DICT_TYPE_CHOICES: tuple[str, ...] = tuple(m.name for m in StateDictType)
AUTO_WRAP_POLICIES: tuple[str, ...] = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
MIXED_PRECISION_CHOICES: tuple[str, ...] = ("no", "fp16", "bf16")


def is_bool_text(value: object) -> bool:
    """Whether ``value`` is a bool or a string that :func:`parse_bool` accepts."""
    return isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE)


def parse_bool(value: object, *, where: str = "value") -> bool:
    """``True``/``False`` from a bool or from true/false, 1/0, yes/no, on/off (any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{where}={value!r}: not a boolean. Use one of true, false (also 1/0, yes/no, on/off).")


def parse_int(value: object, *, where: str = "value", example: int = 100000000) -> int:
    """An integer from an int, a whole float or their text (``"1e8"`` too); ``example`` goes in the error."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            try:  # "1e8", as Accelerate's prompts suggest
                number = float(text)
            except ValueError:
                number = float("nan")
            if number.is_integer():
                return int(number)
    raise ValueError(f"{where}={value!r}: not an integer. Give a whole number such as {example}.")


def _parse_text(value: object, *, where: str = "value") -> str:
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ValueError(f"{where}={value!r}: expected a non-empty string.")


def _parse_names(value: object, *, where: str = "value") -> list[str]:
    """A comma-separated string (or a list) of class names → list of names."""
    items = value.split(",") if isinstance(value, str) else value
    if isinstance(items, (list, tuple)) and all(isinstance(i, str) for i in items):
        names = [i.strip() for i in items if i.strip()]
        if names:
            return names
    raise ValueError(f"{where}={value!r}: expected class names separated by commas, e.g. 'BertLayer,BertEmbeddings'.")


def _choice_parser(choices: tuple[str, ...]) -> Callable[..., str]:
    """A parser that accepts a choice's name in any case, or its 1-based number (Accelerate's old YAML).

    It returns the choice as spelled in ``choices``.
    """

    canonical = {c.upper(): c for c in choices}

    def parse(value: object, *, where: str = "value") -> str:
        if isinstance(value, enum.Enum):  # ours or torch's member: its name
            value = value.name.lstrip("_")
        if isinstance(value, str) and value.strip().upper() in canonical:
            return canonical[value.strip().upper()]
        text = str(value).strip() if isinstance(value, (int, str)) and not isinstance(value, bool) else ""
        if text.isdigit() and 1 <= int(text) <= len(choices):
            return choices[int(text) - 1]
        raise ValueError(f"{where}={value!r}: not a valid choice. Use one of {', '.join(choices)}.")

    return parse


def _parse_reshard(value: object, *, where: str = "value") -> bool | str:
    """``reshard_after_forward``: a bool (FSDP2) or a sharding strategy name (FSDP1)."""
    if is_bool_text(value):
        return parse_bool(value, where=where)
    try:
        return _choice_parser(SHARDING_STRATEGY_CHOICES)(value, where=where)
    except ValueError:
        raise ValueError(
            f"{where}={value!r}: expected true/false (fsdp_version 2) or a sharding strategy "
            f"({', '.join(SHARDING_STRATEGY_CHOICES)}) (fsdp_version 1)."
        ) from None


def _format(value: object) -> str:
    """The text of a parsed value as it goes into the environment (Accelerate's spelling)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    name = getattr(value, "name", None)
    if isinstance(name, str) and not isinstance(value, str):  # an enum member
        return name.lstrip("_")
    return str(value)


@dataclass(frozen=True)
class EnvVar:
    """One setting passed from the launcher to the workers through the environment."""

    field: str
    """Name of the plugin field (or of the launch setting, for :data:`LAUNCH_VARS`)."""
    env: str
    """Name of the environment variable."""
    config_key: str
    """Key in the YAML config (inside ``fsdp_config`` for :data:`FSDP_VARS`); also the launch flag ``--<key>``."""
    parse: Callable[..., Any]
    """``parse(value, where=...)``: text from the environment or a flag, or a YAML value → typed value."""
    help: str
    """One line for ``--help`` and the ``fullshard config`` question."""
    choices: tuple[str, ...] = ()
    """Valid names, for settings that take one of a few names."""
    aliases: tuple[str, ...] = ()
    """Other config keys accepted for the same setting (older Accelerate spellings)."""

    @property
    def flag(self) -> str:
        """The ``fullshard launch`` flag."""
        return f"--{self.config_key}"

    def format(self, value: object) -> str:
        """The environment text for ``value`` (a parsed value or anything :attr:`parse` accepts)."""
        return _format(self.parse(value, where=self.config_key))


def _var(field: str, env: str, key: str, parse: Callable[..., Any], help: str, **kw: Any) -> EnvVar:
    return EnvVar(field=field, env=env, config_key=key, parse=parse, help=help, **kw)


def _choice_var(field: str, env: str, key: str, choices: tuple[str, ...], help: str, **kw: Any) -> EnvVar:
    return _var(field, env, key, _choice_parser(choices), help, choices=choices, **kw)


DEFAULT_FSDP_VERSION = 1
"""The FSDP version when nothing sets one: Accelerate 1.15's plugin reads ``FSDP_VERSION`` with default 1, and
``accelerate launch --fsdp_version`` defaults to 1. The plugin, ``fullshard launch`` and ``fullshard config``
all use this one value."""


def _micro_batches(value: object, *, where: str = "value") -> int:
    """``G`` of world-size-invariant mode: an int >= 0 (0: off); the plugin checks that it is a power of two."""
    count = parse_int(value, where=where, example=8)
    if count < 0:
        raise ValueError(f"{where}={value!r}: the number of micro-batches per step must be >= 0 (0: off).")
    return count


def _version(value: object, *, where: str = "value") -> int:
    version = parse_int(value, where=where)
    if version not in (1, 2):
        raise ValueError(f"{where}={value!r}: FSDP version must be 1 or 2.")
    return version


FSDP_VARS: tuple[EnvVar, ...] = (
    _var("fsdp_version", "FSDP_VERSION", "fsdp_version", _version,
         "FSDP version: 1 (wrapper, the default) or 2 (per-module)."),
    _choice_var(
        "sharding_strategy", "FSDP_SHARDING_STRATEGY", "fsdp_sharding_strategy", SHARDING_STRATEGY_CHOICES,
        "Sharding strategy (FSDP1; superseded by fsdp_reshard_after_forward).",
    ),
    _var(
        "reshard_after_forward", "FSDP_RESHARD_AFTER_FORWARD", "fsdp_reshard_after_forward", _parse_reshard,
        "true/false (FSDP2) or a sharding strategy name (FSDP1).",
    ),
    _var("cpu_offload", "FSDP_OFFLOAD_PARAMS", "fsdp_offload_params", parse_bool,
         "Offload parameters and gradients to the CPU (true/false)."),
    _var("min_num_params", "FSDP_MIN_NUM_PARAMS", "fsdp_min_num_params", parse_int,
         "Minimum parameters of a unit for SIZE_BASED_WRAP."),
    _choice_var("auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY", "fsdp_auto_wrap_policy", AUTO_WRAP_POLICIES,
                "Auto wrap policy."),
    _var(
        "transformer_cls_names_to_wrap", "FSDP_TRANSFORMER_CLS_TO_WRAP", "fsdp_transformer_layer_cls_to_wrap",
        _parse_names, "Comma-separated transformer layer class names for TRANSFORMER_BASED_WRAP.",
    ),
    _choice_var(
        "backward_prefetch", "FSDP_BACKWARD_PREFETCH", "fsdp_backward_prefetch", BACKWARD_PREFETCH_CHOICES,
        "Backward prefetch policy (FSDP1).", aliases=("fsdp_backward_prefetch_policy",),
    ),
    _choice_var("state_dict_type", "FSDP_STATE_DICT_TYPE", "fsdp_state_dict_type", STATE_DICT_TYPE_CHOICES,
                "State dict type used when saving."),
    _var("forward_prefetch", "FSDP_FORWARD_PREFETCH", "fsdp_forward_prefetch", parse_bool,
         "Prefetch the next all-gather during forward (static graphs only; true/false)."),
    _var("use_orig_params", "FSDP_USE_ORIG_PARAMS", "fsdp_use_orig_params", parse_bool,
         "Expose the original parameters to the optimizer (FSDP1; true/false)."),
    _var("cpu_ram_efficient_loading", "FSDP_CPU_RAM_EFFICIENT_LOADING", "fsdp_cpu_ram_efficient_loading",
         parse_bool, "Only rank 0 loads pretrained weights; forces sync_module_states (true/false)."),
    _var("sync_module_states", "FSDP_SYNC_MODULE_STATES", "fsdp_sync_module_states", parse_bool,
         "Broadcast module states from rank 0 at wrap time (true/false)."),
    _var("activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING", "fsdp_activation_checkpointing", parse_bool,
         "Recompute activations in backward instead of storing them (true/false)."),
    _var("ignored_modules", "FSDP_IGNORED_MODULES", "fsdp_ignored_modules", _parse_text,
         "Regular expression (full match) on module names to leave unsharded."),
    # fullshard's own (not Accelerate's): world-size-invariant mode (docs/design.md).
    _var("invariant_micro_batches", "FSDP_INVARIANT_MICRO_BATCHES", "fsdp_invariant_micro_batches", _micro_batches,
         "World-size-invariant mode: G micro-batches per step, a power of two and a multiple of every world size "
         "(0: off)."),
    _var("whole_param_step", "FSDP_WHOLE_PARAM_STEP", "fsdp_whole_param_step", parse_bool,
         "Step matrix optimizers (Muon, Adafactor, registered classes) on whole parameters, one owning rank each "
         "(true/false; default true)."),
)  # fmt: skip

LAUNCH_VARS: tuple[EnvVar, ...] = (
    _var("use_fsdp", "ACCELERATE_USE_FSDP", "use_fsdp", parse_bool, "Shard the model with FSDP."),
    _choice_var("mixed_precision", "ACCELERATE_MIXED_PRECISION", "mixed_precision", MIXED_PRECISION_CHOICES,
                "Mixed precision: no, fp16 or bf16."),
    _var("use_cpu", "ACCELERATE_USE_CPU", "use_cpu", parse_bool, "Train on the CPU even if an accelerator exists."),
    _var("debug", "ACCELERATE_DEBUG_MODE", "debug", parse_bool, "Check distributed operations for errors."),
)  # fmt: skip


# torch.compile settings: the config file's ``dynamo_config`` section (Accelerate's keys), which the launcher turns
# into these variables; TorchDynamoPlugin reads them back for the fields it was not given.
DYNAMO_BACKENDS: tuple[str, ...] = tuple(b.value.lower() for b in DynamoBackend)
"""The backend names ``--dynamo_backend`` takes (Accelerate's list, lower case; ``no``: do not compile)."""
DYNAMO_MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _parse_backend(value: object, *, where: str = "value") -> str:
    """A ``torch.compile`` backend name in any case → Accelerate's spelling in files and variables (``INDUCTOR``)."""
    text = str(getattr(value, "value", value)).strip().upper() if isinstance(value, (str, enum.Enum)) else ""
    if text not in DynamoBackend:
        raise ValueError(
            f"{where}={value!r}: not a torch.compile backend. Use one of {', '.join(DYNAMO_BACKENDS)} "
            "(no: do not compile)."
        )
    return text


DYNAMO_VARS: tuple[EnvVar, ...] = (
    _var("backend", "ACCELERATE_DYNAMO_BACKEND", "dynamo_backend", _parse_backend,
         "torch.compile backend for the model (no, eager, aot_eager, inductor, ...; no: do not compile).",
         choices=DYNAMO_BACKENDS),
    _choice_var("mode", "ACCELERATE_DYNAMO_MODE", "dynamo_mode", DYNAMO_MODES, "torch.compile mode."),
    _var("fullgraph", "ACCELERATE_DYNAMO_USE_FULLGRAPH", "dynamo_use_fullgraph", parse_bool,
         "Refuse graph breaks (true/false)."),
    _var("dynamic", "ACCELERATE_DYNAMO_USE_DYNAMIC", "dynamo_use_dynamic", parse_bool,
         "Trace with dynamic shapes (true/false)."),
    _var("use_regional_compilation", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION",
         "dynamo_use_regional_compilation", parse_bool,
         "Compile each repeated block once and reuse it, instead of the whole model (true/false)."),
)  # fmt: skip


def _size(value: object, *, where: str = "value") -> int:
    size = parse_int(value, where=where, example=2)
    if size < 1:
        raise ValueError(f"{where}={value!r}: a parallelism size must be at least 1.")
    return size


# Accelerate's ParallelismConfig: the config file's ``parallelism_config`` section (keys ``parallelism_config_*``),
# which the launcher turns into these variables (ACCELERATE_USE_PARALLELISM_CONFIG=true when the section is not
# empty); the Accelerator then builds ParallelismConfig() from them, which reads the sizes it was not given.
PARALLELISM_VARS: tuple[EnvVar, ...] = (
    _var("use_parallelism_config", "ACCELERATE_USE_PARALLELISM_CONFIG", "use_parallelism_config", parse_bool,
         "Build Accelerator(parallelism_config=ParallelismConfig()) from these variables (true/false)."),
    _var("dp_replicate_size", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "parallelism_config_dp_replicate_size", _size,
         "Replicas of the sharded model (HSDP's replicate dimension; 1: none)."),
    _var("dp_shard_size", "PARALLELISM_CONFIG_DP_SHARD_SIZE", "parallelism_config_dp_shard_size", _size,
         "Ranks the model is sharded over (FSDP's shard dimension)."),
    _var("tp_size", "PARALLELISM_CONFIG_TP_SIZE", "parallelism_config_tp_size", _size,
         "Tensor parallel ranks (the model arrives tensor parallel over them; 1: none)."),
    _var("cp_size", "PARALLELISM_CONFIG_CP_SIZE", "parallelism_config_cp_size", _size,
         "Context parallel ranks (only 1: fullshard has no context parallelism)."),
    _var("cp_backend", "PARALLELISM_CONFIG_CP_BACKEND", "parallelism_config_cp_backend", _parse_text,
         "Context parallelism backend (Accelerate's: torch)."),
    _var("cp_comm_strategy", "PARALLELISM_CONFIG_CP_COMM_STRATEGY", "parallelism_config_cp_comm_strategy",
         _parse_text, "Context parallelism communication (Accelerate's: allgather or alltoall)."),
    _var("sp_size", "PARALLELISM_CONFIG_SP_SIZE", "parallelism_config_sp_size", _size,
         "Sequence parallel ranks (only 1: fullshard has no DeepSpeed sequence parallelism)."),
    _var("sp_backend", "PARALLELISM_CONFIG_SP_BACKEND", "parallelism_config_sp_backend", _parse_text,
         "Sequence parallelism backend (Accelerate's: deepspeed)."),
)  # fmt: skip


def read_parallelism_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """ParallelismConfig field (and ``use_parallelism_config``) → value, for every variable set in ``environ``."""
    return _read(PARALLELISM_VARS, environ)


def read_dynamo_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """TorchDynamoPlugin field → value, for every ``ACCELERATE_DYNAMO_*`` variable set in ``environ``."""
    return _read(DYNAMO_VARS, environ)


def by_field(field: str, table: Iterable[EnvVar] = FSDP_VARS) -> EnvVar:
    """The table entry of a plugin field (``KeyError`` if it has none)."""
    for var in table:
        if var.field == field:
            return var
    raise KeyError(field)


def by_config_key(key: str, table: Iterable[EnvVar] = FSDP_VARS) -> EnvVar | None:
    """The entry whose config key (or alias) is ``key``; a key without the ``fsdp_`` prefix (``dynamo_`` in
    :data:`DYNAMO_VARS`) also matches, as Accelerate reads its sections."""
    prefix = "fsdp_" if table is FSDP_VARS else "dynamo_" if table is DYNAMO_VARS else None
    candidates = {key, f"{prefix}{key}"} if prefix else {key}
    for var in table:
        if candidates & {var.config_key, *var.aliases}:
            return var
    return None


def _read(table: Iterable[EnvVar], environ: Mapping[str, str] | None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for var in table:
        text = environ.get(var.env)
        if text is None or text.strip() == "" or text.strip().lower() == "none":
            continue
        values[var.field] = var.parse(text, where=f"environment variable {var.env}")
    return values


def read_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Plugin field → parsed value for every ``FSDP_*`` variable set in ``environ`` (default ``os.environ``).

    Unset or empty variables (and the text "None", which Accelerate writes for unset flags) are left out.
    A malformed value raises ``ValueError`` naming the variable.
    """
    return _read(FSDP_VARS, environ)


def read_launch_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Launch setting (``use_fsdp``, ``mixed_precision``, ``use_cpu``, ``debug``) → value, from ``environ``."""
    return _read(LAUNCH_VARS, environ)


def format_env(values: Mapping[str, Any], table: Iterable[EnvVar] = FSDP_VARS) -> dict[str, str]:
    """Environment variables for ``values`` (field → value); ``None`` values are left out.

    Raises ``KeyError`` for a field that has no variable, ``ValueError`` for a value its parser rejects.
    """
    table = tuple(table)
    known = {var.field for var in table}
    unknown = sorted(set(values) - known)
    if unknown:
        raise KeyError(f"no environment variable for {unknown}; known fields: {', '.join(sorted(known))}")
    return {by_field(f, table).env: by_field(f, table).format(v) for f, v in values.items() if v is not None}


def write_field(field: str, value: object, environ: MutableMapping[str, str] | None = None) -> None:
    """Set the variable of one plugin field in ``environ`` (default ``os.environ``).

    The plugin uses it for ``cpu_ram_efficient_loading``, which ``transformers``' ``from_pretrained`` reads
    from ``FSDP_CPU_RAM_EFFICIENT_LOADING`` (as Accelerate does). A bool is written as Accelerate's Python side
    writes it, ``True``/``False`` (the launcher writes ``true``/``false``; both parse the same).
    """
    environ = os.environ if environ is None else environ
    var = by_field(field)
    environ[var.env] = str(value) if isinstance(value, bool) else var.format(value)


def set_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of every table that are set in ``environ`` (default ``os.environ``), as raw text."""
    environ = os.environ if environ is None else environ
    tables = (*LAUNCH_VARS, *FSDP_VARS, *DYNAMO_VARS, *PARALLELISM_VARS)
    return {v.env: environ[v.env] for v in tables if v.env in environ}


@contextlib.contextmanager
def patched(variables: Mapping[str, str]) -> Iterator[None]:
    """Set ``variables`` in ``os.environ`` for the block; restore the previous values afterwards.

    The launcher hands the worker environment this way: torch's elastic agent passes its own environment on.
    """
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

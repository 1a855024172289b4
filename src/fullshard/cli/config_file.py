"""Config files: YAML ↔ :class:`LaunchConfig`, in Accelerate's format.

An Accelerate config file loads as it is: fullshard's keys are Accelerate's, the ``fsdp_config`` and
``dynamo_config`` keys are the config keys of the tables in :mod:`fullshard.frontend.env` (``FSDP_VARS``,
``DYNAMO_VARS``), and Accelerate keys that fullshard has no use for (``tpu_*``, ``same_network``, ...) are
accepted and written back unchanged. Any other key is an error that names it.

The default file is ``$FULLSHARD_HOME/default_config.yaml``, with ``FULLSHARD_HOME`` defaulting to
``$XDG_CACHE_HOME/fullshard`` (``~/.cache/fullshard``), the way Accelerate keeps its file under
``~/.cache/huggingface/accelerate``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fullshard.frontend import env

__all__ = [
    "ACCELERATE_ONLY_KEYS",
    "DISTRIBUTED_TYPES",
    "RDZV_BACKENDS",
    "LaunchConfig",
    "accelerate_default_config_path",
    "default_config_path",
    "did_you_mean",
    "load_config",
    "override",
    "save_config",
]

DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP")
RDZV_BACKENDS = ("static", "c10d")
# Keys of Accelerate's ClusterConfig that fullshard reads past and writes back, unused.
ACCELERATE_ONLY_KEYS = frozenset(
    {
        "command_file", "commands", "deepspeed_config", "downcast_bf16", "enable_cpu_affinity",
        "fp8_config", "gpu_ids", "main_training_function", "megatron_lm_config", "mpirun_config",
        "parallelism_config", "same_network", "tpu_env", "tpu_name", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm",
        "tpu_zone",
    }
)  # fmt: skip
# (parallelism_config is kept in ``extra`` too, and turned into PARALLELISM_CONFIG_* by cli/launch_plan.py.)


@dataclass
class LaunchConfig:
    """What ``fullshard launch`` needs: the processes to start and the settings to hand them."""

    compute_environment: str = "LOCAL_MACHINE"
    """Only LOCAL_MACHINE (Accelerate's cloud launchers are not part of fullshard)."""
    distributed_type: str = "NO"
    """FSDP shards the model; NO, MULTI_CPU and MULTI_GPU start the processes without FSDP settings."""
    mixed_precision: str = "no"
    """no, fp16 or bf16."""
    use_cpu: bool = False
    """Train on the CPU (gloo) even if an accelerator is present."""
    debug: bool = False
    """Check distributed operations for errors (slower)."""
    num_processes: int = 1
    """Worker processes in total, over all machines."""
    num_machines: int = 1
    """Machines (nodes) taking part; with ``min_machines``, the most that may take part."""
    min_machines: int | None = None
    """An elastic job's fewest machines (torchrun's ``--nnodes MIN:MAX`` is ``min_machines: MIN``, ``num_machines:
    MAX``): it starts once this many have joined the c10d rendezvous and goes on, after a restart, on the machines
    that are left. ``None``: exactly ``num_machines``."""
    machine_rank: int = 0
    """This machine's rank, 0 to num_machines - 1; machine 0 hosts the main process."""
    main_process_ip: str | None = None
    """Address of machine 0 (needed when num_machines > 1)."""
    main_process_port: int | None = None
    """Port on machine 0 for the rendezvous; a free one is picked on a single machine when ``None``."""
    rdzv_backend: str = "static"
    """static (fixed machine ranks) or c10d (elastic rendezvous at main_process_ip:main_process_port)."""
    max_restarts: int = 0
    """How many times torch's elastic agent restarts the workers after a failure."""
    fsdp_config: dict[str, Any] = field(default_factory=dict)
    """Plugin field → value, for the FSDP settings the file sets (entries of ``env.FSDP_VARS``)."""
    dynamo_config: dict[str, Any] = field(default_factory=dict)
    """TorchDynamoPlugin field → value, for the ``torch.compile`` settings the file sets (``env.DYNAMO_VARS``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Accelerate keys that fullshard keeps but does not use (see ``ACCELERATE_ONLY_KEYS``)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name)))
        _check_ranges(self)

    @property
    def use_fsdp(self) -> bool:
        """Whether the workers shard with FSDP."""
        return self.distributed_type == "FSDP"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> LaunchConfig:
        """Build from a YAML mapping; errors name ``source`` and the keys involved."""
        own = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = sorted(set(data) - own - ACCELERATE_ONLY_KEYS - {"dynamo_backend"})
        if unknown:
            raise ValueError(
                f"{source}: unknown keys {unknown}{did_you_mean(unknown, own)}. Remove them or fix their spelling; "
                f"known keys are {', '.join(sorted(own | ACCELERATE_ONLY_KEYS))}."
            )
        kwargs = {k: v for k, v in data.items() if k in own and v is not None}
        if data.get("dynamo_backend") is not None:  # Accelerate < 0.18's top-level key, as Accelerate reads it
            kwargs["dynamo_config"] = {**(data.get("dynamo_config") or {}), "dynamo_backend": data["dynamo_backend"]}
        extra = {k: v for k, v in data.items() if k in ACCELERATE_ONLY_KEYS}
        try:
            return cls(**kwargs, extra=extra)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The YAML mapping (Accelerate's keys; ``fsdp_config`` and ``dynamo_config`` only when set)."""
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data.pop("extra")
        data["fsdp_config"] = {env.by_field(k).config_key: _yaml_value(v) for k, v in self.fsdp_config.items()}
        data["dynamo_config"] = {env.by_field(k, env.DYNAMO_VARS).config_key: v for k, v in self.dynamo_config.items()}
        unset = {"main_process_ip": None, "main_process_port": None, "max_restarts": 0, "min_machines": None}
        for key, value in unset.items():
            if data[key] == value:
                del data[key]  # keeps the file readable by Accelerate, which has no max_restarts key
        for section in ("fsdp_config", "dynamo_config"):
            if not data[section]:
                del data[section]
        return {**self.extra, **data}


def did_you_mean(wrong: list[str], known: Any) -> str:
    """`` (did you mean X?)`` for the known names closest to each of ``wrong``, or ``""`` when none is close."""
    close = [match for name in wrong for match in difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)]
    return f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""


def _yaml_value(value: Any) -> Any:
    return ",".join(value) if isinstance(value, list) else value


# The integer fields, each with a value to suggest when one is not an integer.
_INT_EXAMPLES = {
    "num_processes": 2,
    "num_machines": 1,
    "min_machines": 1,
    "machine_rank": 0,
    "main_process_port": 29500,
    "max_restarts": 3,
}


def _coerce(name: str, value: Any) -> Any:
    """Check and normalise one field (YAML values or command-line text)."""
    where = f"{name}"
    if value is None or name == "extra":
        return value
    if name in ("use_cpu", "debug"):
        return env.parse_bool(value, where=where)
    if name in _INT_EXAMPLES:
        return env.parse_int(value, where=where, example=_INT_EXAMPLES[name])
    if name == "mixed_precision":
        return env.by_field("mixed_precision", env.LAUNCH_VARS).parse(value, where=where)
    if name == "fsdp_config":
        return _coerce_section(name, value, env.FSDP_VARS)
    if name == "dynamo_config":
        return _coerce_section(name, value, env.DYNAMO_VARS)
    choices = {"compute_environment": ("LOCAL_MACHINE",), "distributed_type": DISTRIBUTED_TYPES}
    if name in choices:
        return _one_of(where, value, choices[name], upper=True)
    if name == "rdzv_backend":
        return _one_of(where, value, RDZV_BACKENDS, upper=False)
    return str(value)


def _one_of(where: str, value: Any, choices: tuple[str, ...], *, upper: bool) -> str:
    text = str(value).strip()
    text = text.upper() if upper else text.lower()
    if text not in choices:
        raise ValueError(f"{where}={value!r}: not supported by fullshard. Use one of {', '.join(choices)}.")
    return text


def _coerce_section(section: str, value: Any, table: tuple[env.EnvVar, ...]) -> dict[str, Any]:
    """A section's config keys (``fsdp_*`` / ``dynamo_*``, with or without the prefix, or plugin field names)
    → field → parsed value."""
    prefix = section.removesuffix("config")
    if not isinstance(value, Mapping):
        raise ValueError(f"{section}={value!r}: expected a mapping of {prefix}* keys to values.")
    result: dict[str, Any] = {}
    for key, item in value.items():
        var = env.by_config_key(str(key), table) or next((v for v in table if v.field == key), None)
        if var is None:
            keys = [v.config_key for v in table]
            raise ValueError(
                f"{section} has an unknown key {key!r}{did_you_mean([str(key)], keys)}. Remove it or use one of: "
                f"{', '.join(keys)}."
            )
        if var.field in result:
            raise ValueError(f"{section} sets {var.config_key} twice (as {key!r}). Keep one of them.")
        if item is not None:
            result[var.field] = var.parse(item, where=f"{section}.{var.config_key}")
    return result


def _check_ranges(cfg: LaunchConfig) -> None:
    for name in ("num_processes", "num_machines"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}={getattr(cfg, name)}: must be at least 1.")
    if cfg.min_machines is not None and not 1 <= cfg.min_machines <= cfg.num_machines:
        raise ValueError(
            f"min_machines={cfg.min_machines} with num_machines={cfg.num_machines}: an elastic range needs "
            f"1 <= min_machines <= num_machines, e.g. --nnodes 1:{cfg.num_machines}."
        )
    if not 0 <= cfg.machine_rank < cfg.num_machines:
        raise ValueError(
            f"machine_rank={cfg.machine_rank}: must be between 0 and num_machines - 1 = {cfg.num_machines - 1}."
        )
    if cfg.main_process_port is not None and not 0 <= cfg.main_process_port <= 65535:
        raise ValueError(f"main_process_port={cfg.main_process_port}: not a port; use 1-65535 (0: pick a free one).")
    if cfg.max_restarts < 0:
        raise ValueError(f"max_restarts={cfg.max_restarts}: must be 0 or more.")


def default_config_path() -> Path:
    """``$FULLSHARD_HOME/default_config.yaml`` (``FULLSHARD_HOME`` defaults to ``$XDG_CACHE_HOME/fullshard``)."""
    home = os.environ.get("FULLSHARD_HOME")
    if not home:
        home = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "fullshard")
    return Path(home) / "default_config.yaml"


def accelerate_default_config_path() -> Path:
    """Where ``accelerate config`` writes its default file: ``$HF_HOME/accelerate/default_config.yaml``
    (``HF_HOME`` defaulting to ``$XDG_CACHE_HOME/huggingface``, ``~/.cache/huggingface``). ``fullshard launch``
    does not read it unless it is passed with ``--config_file``."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"


def load_config(path: str | os.PathLike[str] | None = None) -> tuple[LaunchConfig, Path | None]:
    """Read ``path`` (or the default file, if it exists); return the config and the file it came from.

    Without a path and without a default file, the defaults of :class:`LaunchConfig` are returned with ``None``.
    """
    if path is None:
        default = default_config_path()
        if not default.is_file():
            return LaunchConfig(), None
        path = default
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"config file {str(path)!r}: no such file. Run `fullshard config` to write one, or fix the path."
        )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {str(path)!r}: not valid YAML ({exc}).") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"config file {str(path)!r}: expected a mapping of keys to values, got {type(data).__name__}.")
    return LaunchConfig.from_dict(data, source=f"config file {str(path)!r}"), path


def save_config(cfg: LaunchConfig, path: str | os.PathLike[str]) -> Path:
    """Write ``cfg`` as YAML (keys sorted, as Accelerate writes them); create the folder if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=True), encoding="utf-8")
    return path


def override(cfg: LaunchConfig, values: Mapping[str, Any]) -> LaunchConfig:
    """A copy of ``cfg`` with ``values`` (command-line flags) applied; ``None`` values are skipped.

    Keys are :class:`LaunchConfig` fields, ``fsdp_*`` and ``dynamo_*`` config keys, ``use_fsdp`` (True selects
    FSDP) and ``cpu`` (True sets ``use_cpu``). On/off flags (``use_fsdp``, ``cpu``, ``debug``) only switch on.
    """
    changes: dict[str, Any] = {}
    fsdp = dict(cfg.fsdp_config)
    dynamo = dict(cfg.dynamo_config)
    own = {f.name for f in dataclasses.fields(LaunchConfig)}
    for key, value in values.items():
        var = env.by_config_key(key) if key.startswith("fsdp_") else None
        dynamo_var = env.by_config_key(key, env.DYNAMO_VARS) if key.startswith("dynamo_") else None
        if value is None or (key in ("use_fsdp", "cpu", "debug") and not value):
            continue
        if var is not None:
            fsdp[var.field] = var.parse(value, where=f"--{key}")
        elif dynamo_var is not None:
            dynamo[dynamo_var.field] = dynamo_var.parse(value, where=f"--{key}")
        elif key == "use_fsdp":
            changes["distributed_type"] = "FSDP"
        elif key == "cpu":
            changes["use_cpu"] = True
        elif key in own:
            changes[key] = value
        else:
            raise KeyError(f"override(): {key!r} is neither a LaunchConfig field nor an fsdp_* or dynamo_* key.")
    return dataclasses.replace(cfg, **changes, fsdp_config=fsdp, dynamo_config=dynamo)

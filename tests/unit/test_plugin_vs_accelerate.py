"""``FullyShardedDataParallelPlugin(fsdp_version=2)`` reads as Accelerate's plugin does, field by field.

Built with the same arguments (or the same ``FSDP_*`` environment that ``accelerate launch`` writes for a
version-2 config) both plugins must agree: ``sharding_strategy`` is ``None``, ``reshard_after_forward`` a
``bool``, ``backward_prefetch`` dropped (ours warns), and the other shared fields equal after normalising
torch's objects to names and field values. The engine then gets ``reshard_after_forward`` from
``fully_shard_kwargs()``.

Left out on purpose: ``use_orig_params``, ``sync_module_states`` and ``forward_prefetch``, which Accelerate sets
to ``None`` for version 2 and ours keeps as bools (the engine honours ``sync_module_states`` under
``fully_shard``); and ``param_init_fn``, which Accelerate fills only for version 1.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from fullshard import FullyShardedDataParallelPlugin

COMPARED = (
    "fsdp_version",
    "sharding_strategy",
    "reshard_after_forward",
    "backward_prefetch",
    "cpu_offload",
    "mixed_precision_policy",
    "auto_wrap_policy",
    "state_dict_type",
    "state_dict_config",
    "optim_state_dict_config",
    "activation_checkpointing",
    "cpu_ram_efficient_loading",
    "transformer_cls_names_to_wrap",
    "min_num_params",
)


@pytest.fixture(autouse=True)
def clean_environ() -> Iterator[None]:
    """No FSDP_* variables from outside; whatever either plugin writes is undone afterwards."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith(("FSDP_", "ACCELERATE_"))]:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def normalise(value: Any) -> Any:
    """Torch's, Accelerate's and our objects as comparable plain values (names, field dicts)."""
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value):
        fields = {f.name: normalise(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return (type(value).__name__, {k: v for k, v in fields.items() if not k.startswith("_")})
    if callable(value):
        return getattr(value, "__name__", repr(value))
    return value


def both(**kwargs: Any) -> tuple[FullyShardedDataParallelPlugin, Any, list[str]]:
    from accelerate.utils import FullyShardedDataParallelPlugin as AcceleratePlugin

    theirs = AcceleratePlugin(**kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = FullyShardedDataParallelPlugin(**kwargs)
    return ours, theirs, [str(w.message) for w in caught]


def assert_same_fields(ours: FullyShardedDataParallelPlugin, theirs: Any, skip: tuple[str, ...] = ()) -> None:
    for name in set(COMPARED) - set(skip):
        assert normalise(getattr(ours, name)) == normalise(getattr(theirs, name)), name
    assert ours.sharding_strategy is None and isinstance(ours.reshard_after_forward, bool)
    assert ours.fully_shard_kwargs()["reshard_after_forward"] is theirs.reshard_after_forward


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"reshard_after_forward": False},
        {"reshard_after_forward": "false"},
        {"reshard_after_forward": True, "cpu_offload": True, "mixed_precision_policy": "bf16"},
        {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Block"]},
        {"auto_wrap_policy": "size_based_wrap", "min_num_params": 1000, "activation_checkpointing": True},
        {"state_dict_type": "FULL_STATE_DICT", "cpu_ram_efficient_loading": True},
    ],
    ids=["defaults", "raf_false", "raf_text", "offload_bf16", "transformer_wrap", "size_wrap", "full_state_dict"],
)
def test_arguments_read_as_accelerate_reads_them(kwargs: dict[str, Any]) -> None:
    ours, theirs, _ = both(fsdp_version=2, **kwargs)
    assert_same_fields(ours, theirs)


@pytest.mark.parametrize("prefetch", ["BACKWARD_PRE", "backward_post", "torch_enum"])
def test_backward_prefetch_is_dropped_with_a_warning(prefetch: str) -> None:
    from torch.distributed.fsdp import BackwardPrefetch

    value = BackwardPrefetch.BACKWARD_POST if prefetch == "torch_enum" else prefetch
    ours, theirs, messages = both(fsdp_version=2, backward_prefetch=value)
    assert_same_fields(ours, theirs)
    assert ours.backward_prefetch is None is theirs.backward_prefetch
    assert any("backward_prefetch is set to None" in m for m in messages), messages


# What `accelerate launch` writes for a version-2 config (utils/launch.py): the sharding strategy is the flag's
# default, the config's choice is in FSDP_RESHARD_AFTER_FORWARD.
LAUNCH_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_MIN_NUM_PARAMS": "0",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "BertLayer",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_FORWARD_PREFETCH": "false",
    "FSDP_USE_ORIG_PARAMS": "true",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
    "FSDP_SYNC_MODULE_STATES": "false",
    "FSDP_ACTIVATION_CHECKPOINTING": "true",
}


@pytest.mark.parametrize("reshard", ["true", "false"])
@pytest.mark.parametrize("prefetch", [None, "BACKWARD_PRE"])
def test_launcher_environment_reads_as_accelerate_reads_it(reshard: str, prefetch: str | None) -> None:
    os.environ.update(LAUNCH_ENV)
    os.environ["FSDP_RESHARD_AFTER_FORWARD"] = reshard
    if prefetch is not None:
        os.environ["FSDP_BACKWARD_PREFETCH"] = prefetch
    ours, theirs, _ = both()
    # Accelerate reads FSDP_MIN_NUM_PARAMS only under size_based_wrap; ours always (unused by other policies).
    assert_same_fields(ours, theirs, skip=("min_num_params",))
    assert ours.reshard_after_forward is (reshard == "true")

"""The systems the benchmarks compare, built one way for every script: fullshard's two entry points beside torch's.

A :class:`System` wraps a freshly built ``TinyGPT`` (one unit per ``Block``) and says which sharding strategy
its traffic follows, whether it computes in bf16, which environment it runs under, and how it skips gradient
synchronisation (``no_sync()`` or ``set_requires_gradient_sync(False)``); it also knows the entry point a user
calls for it and its baseline, the torch FSDP2 system of the same precision that a script compares it with.
:func:`system` looks one up by the name the scripts print and take on ``--systems``; ``" +AC"`` after a name
checkpoints every block first. The names, and the lists of systems each script compares by default, live here
only: the scripts take them from this module.

This is the only place the benchmarks import torch's FSDP, and Accelerate (``src/`` may import neither). What the
benchmarks measure with (the machine description, the RSS sampler, starting ranks) is :mod:`fullshard.testing.bench`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch import nn

from fullshard import FullyShardedDataParallel as OurFSDP
from fullshard import MixedPrecision
from fullshard.algorithms.checkpointing import checkpoint_module
from fullshard.engine.collective_check import CHECK_VAR
from fullshard.engine.local_step import ENV_VAR as LOCAL_STEP_ENV_VAR
from fullshard.engine.p2p import ENV_VAR as P2P_ENV_VAR
from fullshard.engine.shm import ENV_VAR as SHM_ENV_VAR
from fullshard.testing.models import Block
from fullshard.testing.parity import fully_shard_blocks, without_sync
from fullshard.wrap import ModuleWrapPolicy

BF16_MP = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


# --- builders: each takes the model and returns it wrapped ------------------------------------------------


def ours_fsdp(
    model: nn.Module,
    strategy: str = "FULL_SHARD",
    mixed_precision: MixedPrecision | None = None,
    prefetch: str = "default",
) -> nn.Module:
    """fullshard's ``FullyShardedDataParallel``; prefetch "none" (gather on demand), "default"
    (BACKWARD_PRE) or "all" (+ forward prefetch)."""
    return OurFSDP(
        model,
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        mixed_precision=mixed_precision,
        backward_prefetch=None if prefetch == "none" else "BACKWARD_PRE",
        forward_prefetch=prefetch == "all",
    )


def ours_fully_shard(model: nn.Module, bf16: bool = False) -> nn.Module:
    from fullshard import MixedPrecisionPolicy

    kwargs = (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)} if bf16 else {}
    )
    return fully_shard_blocks(model, **kwargs)


def torch_fsdp2(model: nn.Module, bf16: bool = False) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)} if bf16 else {}
    )
    return fully_shard_blocks(model, shard=fully_shard, reshard_after_forward=True, **kwargs)


def torch_fsdp1(model: nn.Module, strategy: str = "FULL_SHARD", bf16: bool = False) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    mp = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None
    return FullyShardedDataParallel(
        model,
        mixed_precision=mp,
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=TorchPolicy({Block}),
        use_orig_params=True,
        # FSDP1 refuses CPU unless told explicitly; on a GPU, the model's device
        device_id=next(model.parameters()).device,
    )


def ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


# --- LoRA fine-tuning (``lora.py``): a PEFT model, one unit per decoder layer, bf16 compute ---------------------


def lora_policy_kwargs(torch_peer: bool) -> dict[str, Any]:
    """bf16 gathers and reductions, as ``Accelerator(mixed_precision="bf16")`` sets them for FSDP2."""
    if torch_peer:
        from torch.distributed.fsdp import MixedPrecisionPolicy as Policy
    else:
        from fullshard import MixedPrecisionPolicy as Policy
    return {"mp_policy": Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16)}


def lora_units(model: nn.Module, layer_cls: type[nn.Module], shard: Callable[..., Any], **kwargs: Any) -> nn.Module:
    for module in [m for m in model.modules() if isinstance(m, layer_cls)]:
        shard(module, **kwargs)
    shard(model, **kwargs)
    return model


def lora_ours_fully_shard(model: nn.Module, layer_cls: type[nn.Module]) -> nn.Module:
    from fullshard import fully_shard

    return lora_units(model, layer_cls, fully_shard, **lora_policy_kwargs(False))


def lora_ours_accelerate_units(model: nn.Module, layer_cls: type[nn.Module]) -> nn.Module:
    """fullshard's ``fully_shard`` on the units Accelerate 1.15 builds for FSDP2 (see :func:`lora_torch_fsdp2`): each
    decoder layer, the input embedding, the tail [final norm, ``lm_head``] kept gathered after forward, the root."""
    from fullshard import fully_shard

    policy = lora_policy_kwargs(False)
    for module in [m for m in model.modules() if isinstance(m, layer_cls)]:
        fully_shard(module, **policy)
    fully_shard(model.get_input_embeddings(), **policy)
    inner = model.get_base_model()
    fully_shard([inner.model.norm, model.get_output_embeddings()], reshard_after_forward=False, **policy)
    fully_shard(model, **policy)
    return model


def lora_lean_units(
    model: nn.Module, layer_cls: type[nn.Module], shard: Callable[..., Any], **policy: Any
) -> nn.Module:
    """The smallest units a LoRA run can gather, with activation checkpointing: every decoder layer recomputes its
    forward in backward, every LoRA-wrapped projection (its frozen ``base_layer`` with its adapters) is a unit of
    its own inside its layer's unit (norms), the input embedding and ``lm_head`` are units, the root holds the
    final norm. At most two projections (the largest 21 MiB in bf16 at 840M) are gathered at a time instead of two
    decoder layers (96 MiB each), and backward keeps one layer's inputs per layer instead of its activations.
    ``shard`` is fullshard's or torch's ``fully_shard``: the same units for both."""
    for layer in [m for m in model.modules() if isinstance(m, layer_cls)]:
        checkpoint_module(layer)
        for module in layer.modules():
            if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
                shard(module, **policy)
        shard(layer, **policy)
    shard(model.get_input_embeddings(), **policy)
    shard(model.get_output_embeddings(), **policy)
    shard(model, **policy)
    return model


def lora_ours_lean(model: nn.Module, layer_cls: type[nn.Module]) -> nn.Module:
    from fullshard import fully_shard

    return lora_lean_units(model, layer_cls, fully_shard, **lora_policy_kwargs(False))


def lora_torch_fsdp2_lean(model: nn.Module, layer_cls: type[nn.Module]) -> nn.Module:
    """torch's ``fully_shard`` on :func:`lora_lean_units`' units, bf16 policy as the fullshard row (no autocast:
    both compute in the gathered bf16 weights)."""
    from torch.distributed.fsdp import fully_shard

    return lora_lean_units(model, layer_cls, fully_shard, **lora_policy_kwargs(True))


def lora_ours_fsdp(model: nn.Module, layer_cls: type[nn.Module]) -> nn.Module:
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, cast_forward_inputs=True)
    return OurFSDP(model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}), mixed_precision=mp, use_orig_params=True)


def lora_ours_accelerator(model: nn.Module, layer_cls: type[nn.Module]) -> nn.Module:
    """fullshard's own ``Accelerator`` with the settings of the torch row: FSDP2, each decoder layer a unit
    (``transformer_based_wrap``), ``mixed_precision="bf16"``."""
    from fullshard import Accelerator, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=[layer_cls.__name__]
    )
    return Accelerator(fsdp_plugin=plugin, mixed_precision="bf16").prepare(model)


def lora_torch_fsdp2(model: nn.Module, layer_cls: type[nn.Module], upcast_all: bool = False) -> nn.Module:
    """torch's FSDP2 prepared by Accelerate 1.15's own ``fsdp2_prepare_model``, with the plugin
    ``Accelerator(fsdp_plugin=..., mixed_precision="bf16")`` builds: each decoder layer a unit
    (``transformer_based_wrap``), the input embedding and the tail (final norm, ``lm_head``) units of their own,
    bf16 policy, and only non-fp32 *trainable* parameters upcast to fp32 (accelerate#3848, the fix of #3844: the
    frozen bf16 base stays bf16). The forward runs under bf16 autocast with fp32 outputs, as ``prepare_model``
    wraps it on CPU. Accelerate itself never selects FSDP on CPU (``MULTI_CPU`` is not among the types that become
    ``FSDP``), hence the call to its preparing function rather than to ``Accelerator.prepare``.

    ``upcast_all``: the whole model cast to fp32 first, what Accelerate did before #3848 (the complaint of
    accelerate#3844 and #3474)."""
    import types

    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import convert_outputs_to_fp32
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    if upcast_all:
        model = model.float()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=[layer_cls.__name__]
    )
    plugin.set_mixed_precision("bf16")
    rank = torch.distributed.get_rank()
    state = types.SimpleNamespace(fsdp_plugin=plugin)
    accelerator = types.SimpleNamespace(
        state=state, mixed_precision="bf16", is_main_process=rank == 0, device=torch.device("cpu")
    )
    model = fsdp2_prepare_model(accelerator, model)
    forward = model.forward.__func__

    @functools.wraps(forward)
    def autocast_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(self, *args, **kwargs)

    model.forward = types.MethodType(convert_outputs_to_fp32(autocast_forward), model)
    return model


# --- the registry --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class System:
    """One system to compare: how to wrap a model, and what to expect of it."""

    name: str
    wrap: Callable[[nn.Module], nn.Module]
    strategy: str = "FULL_SHARD"  # whose traffic formula applies: FULL_SHARD 3x, SHARD_GRAD_OP and NO_SHARD 2x
    bf16: bool = False  # computes (and communicates) in bf16
    env: dict[str, str] = field(default_factory=dict)  # set while it is built and while it steps
    checkpointed: bool = False  # every block under activation checkpointing
    entry_point: str = ""  # what a user calls to get it (peaks.json records it)
    key: str = ""  # its name in SYSTEMS (``name`` may be a short alias and end in " +AC"); set by :func:`system`

    @property
    def ours(self) -> bool:
        """Built with one of fullshard's entry points (not torch's)."""
        return self.entry_point in OUR_ENTRY_POINTS

    @property
    def baseline(self) -> str:
        """The name (in SYSTEMS) of the torch FSDP2 system of the same precision, which a row is compared with."""
        return FSDP2_BF16 if self.bf16 else FSDP2

    def is_baseline_of(self, other: System) -> bool:
        """This system is ``other``'s baseline, with the same activation checkpointing (and not ``other`` itself)."""
        return self.key == other.baseline != other.key and self.checkpointed == other.checkpointed

    def build(self, model: nn.Module) -> nn.Module:
        if self.checkpointed:
            for block in model.blocks:
                checkpoint_module(block)
        with self.environment():
            return self.wrap(model)

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        with mock.patch.dict(os.environ, self.env):
            yield

    @staticmethod
    def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient synchronisation: ``no_sync()`` (FSDP class, DDP) or ``set_requires_gradient_sync``."""
        return without_sync(model)


# Rows with this suffix run with gloo's own reduce-scatter and all-gather; the others with the engine's choice.
GLOO_NATIVE = ", gloo collectives"
_GLOO = {P2P_ENV_VAR: "0"}
# ... and with this suffix without the header that checks ranks are in step (see engine/collective_check.py):
# the check's cost is the ratio of the two rows.
UNCHECKED = ", unchecked"
_UNCHECKED = {CHECK_VAR: "0"}

# ... and with this suffix through gloo's sockets even where the ranks share a host (FULLSHARD_CPU_SHM=0; the
# others go through shared memory there, engine/shm.py).
SOCKETS = ", sockets"
_SOCKETS = {SHM_ENV_VAR: "0"}

# ... and with this suffix with the optimizer stepping the DTensor parameters, as under torch FSDP2
# (FULLSHARD_LOCAL_OPTIMIZER_STEP=0; the others step their local tensors, engine/local_step.py).
DTENSOR_STEP = ", DTensor optimizer step"
_DTENSOR_STEP = {LOCAL_STEP_ENV_VAR: "0"}

# Entry points (``System.entry_point``).
FSDP_CLASS, FULLY_SHARD = "FullyShardedDataParallel", "fully_shard"
OUR_ENTRY_POINTS = (FSDP_CLASS, FULLY_SHARD)
_TORCH_FSDP2, _TORCH_FSDP1 = "torch.distributed.fsdp.fully_shard", "torch.distributed.fsdp.FullyShardedDataParallel"
_TORCH_DDP = "torch.nn.parallel.DistributedDataParallel"

# The names the scripts use (a row's label and a key of SYSTEMS).
OURS_FSDP = "fullshard FSDP FULL_SHARD"
OURS_FULLY_SHARD = "fullshard fully_shard"
FSDP2 = "torch FSDP2 fully_shard"
FSDP1 = "torch FSDP1 FULL_SHARD"
DDP = "torch DDP"
OURS_FSDP_BF16 = "fullshard FSDP bf16, backward prefetch"
OURS_FSDP_BF16_ON_DEMAND = "fullshard FSDP bf16, no prefetch"
OURS_FSDP_BF16_PREFETCH_ALL = "fullshard FSDP bf16, fwd+bwd prefetch"
OURS_FULLY_SHARD_BF16 = "fullshard fully_shard bf16"
FSDP2_BF16 = "torch FSDP2 bf16"
FSDP1_BF16 = "torch FSDP1 bf16"
# Short names (``train.py memory``, ``compile.py`` and their results use them): the FULL_SHARD system of each
# entry point.
SHORT_FSDP, SHORT_FSDP2 = "fullshard FSDP", "torch FSDP2"

_ours = {"entry_point": FSDP_CLASS}
_ours_fs = {"entry_point": FULLY_SHARD}

SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System(OURS_FSDP, ours_fsdp, **_ours),
        System(
            "fullshard FSDP SHARD_GRAD_OP",
            functools.partial(ours_fsdp, strategy="SHARD_GRAD_OP"),
            "SHARD_GRAD_OP",
            **_ours,
        ),
        System("fullshard FSDP NO_SHARD", functools.partial(ours_fsdp, strategy="NO_SHARD"), "NO_SHARD", **_ours),
        System(OURS_FULLY_SHARD, ours_fully_shard, **_ours_fs),
        System(FSDP2, torch_fsdp2, entry_point=_TORCH_FSDP2),
        System(FSDP1, torch_fsdp1, entry_point=_TORCH_FSDP1),
        System(DDP, ddp, "NO_SHARD", entry_point=_TORCH_DDP),
        System(f"{OURS_FSDP}{GLOO_NATIVE}", ours_fsdp, env=_GLOO, **_ours),
        System(f"{OURS_FULLY_SHARD}{GLOO_NATIVE}", ours_fully_shard, env=_GLOO, **_ours_fs),
        System(f"{OURS_FSDP}{UNCHECKED}", ours_fsdp, env=_UNCHECKED, **_ours),
        System(f"{OURS_FULLY_SHARD}{UNCHECKED}", ours_fully_shard, env=_UNCHECKED, **_ours_fs),
        System(f"{OURS_FSDP}{SOCKETS}", ours_fsdp, env=_SOCKETS, **_ours),
        System(f"{OURS_FULLY_SHARD}{SOCKETS}", ours_fully_shard, env=_SOCKETS, **_ours_fs),
        System(f"{OURS_FULLY_SHARD}{DTENSOR_STEP}", ours_fully_shard, env=_DTENSOR_STEP, **_ours_fs),
        System(
            OURS_FSDP_BF16_ON_DEMAND,
            functools.partial(ours_fsdp, mixed_precision=BF16_MP, prefetch="none"),
            bf16=True,
            **_ours,
        ),
        System(OURS_FSDP_BF16, functools.partial(ours_fsdp, mixed_precision=BF16_MP), bf16=True, **_ours),
        System(
            OURS_FSDP_BF16_PREFETCH_ALL,
            functools.partial(ours_fsdp, mixed_precision=BF16_MP, prefetch="all"),
            bf16=True,
            **_ours,
        ),
        System(OURS_FULLY_SHARD_BF16, functools.partial(ours_fully_shard, bf16=True), bf16=True, **_ours_fs),
        System(FSDP2_BF16, functools.partial(torch_fsdp2, bf16=True), bf16=True, entry_point=_TORCH_FSDP2),
        System(FSDP1_BF16, functools.partial(torch_fsdp1, bf16=True), bf16=True, entry_point=_TORCH_FSDP1),
    )
}
ALIASES = {SHORT_FSDP: OURS_FSDP, SHORT_FSDP2: FSDP2}
AC_SUFFIX = " +AC"

# --- what each script compares by default ----------------------------------------------------------------
# ``train.py memory`` (each with and without " +AC"; ``plot.py`` colours them): one system per entry point
MEMORY = (SHORT_FSDP, OURS_FULLY_SHARD, SHORT_FSDP2)
COMPILE = (OURS_FULLY_SHARD, SHORT_FSDP2)  # ``compile.py``: the two that shard with ``fully_shard``
DISPATCH = (OURS_FULLY_SHARD, FSDP2, OURS_FULLY_SHARD_BF16, FSDP2_BF16)  # ``dispatch.py``
GPU_FP32 = (FSDP2, OURS_FULLY_SHARD, OURS_FSDP, FSDP1, DDP)  # ``gpu.py``
GPU_BF16 = (FSDP2_BF16, OURS_FULLY_SHARD_BF16, OURS_FSDP_BF16, FSDP1_BF16)
TRACE_DEFAULT = OURS_FSDP  # ``train.py steps --trace``
# ``lora.py``: each system's builder takes (PEFT model, decoder layer class); rows are compared with torch FSDP2.
# QLoRA runs these same systems on ``lora.py --base nf4`` (the base is lora.py's BASES, not a system).
LORA_ACCELERATOR = "fullshard Accelerator (FSDP2)"
LORA_FSDP2_UPCAST = "torch FSDP2, all fp32 (Accelerate < #3848)"
LORA_ACCELERATE_UNITS = "fullshard fully_shard, Accelerate's units"
LORA_LEAN = "fullshard fully_shard, projection units +AC"
LORA_FSDP2_LEAN = "torch FSDP2, projection units +AC"
LORA_SYSTEMS: dict[str, Callable[[nn.Module, type[nn.Module]], nn.Module]] = {
    OURS_FULLY_SHARD: lora_ours_fully_shard,
    SHORT_FSDP: lora_ours_fsdp,
    LORA_ACCELERATOR: lora_ours_accelerator,
    LORA_ACCELERATE_UNITS: lora_ours_accelerate_units,
    SHORT_FSDP2: lora_torch_fsdp2,
    LORA_FSDP2_UPCAST: functools.partial(lora_torch_fsdp2, upcast_all=True),
    LORA_LEAN: lora_ours_lean,
    LORA_FSDP2_LEAN: lora_torch_fsdp2_lean,
}
LORA_BASELINE = SHORT_FSDP2
# ``muon.py``: (system, optimizer set-up) rows; the first is the baseline of its ratios
MATRIX_OPTIMIZER_ROWS = ((OURS_FULLY_SHARD, "adamw"), (OURS_FULLY_SHARD, "muon"), (FSDP2, "muon"))


def system(name: str) -> System:
    """The system called ``name`` (a key of SYSTEMS or ALIASES), under that name; ``" +AC"`` at the end
    checkpoints every block before wrapping."""
    checkpointed = name.endswith(AC_SUFFIX)
    base = name.removesuffix(AC_SUFFIX)
    found = SYSTEMS.get(ALIASES.get(base, base))
    if found is None:
        known = ", ".join(repr(n) for n in [*SYSTEMS, *ALIASES])
        raise ValueError(f"system {name!r} is unknown: expected one of {known}, optionally followed by {AC_SUFFIX!r}")
    return dataclasses.replace(found, name=name, checkpointed=checkpointed, key=found.name)

"""Per-rank memory of sharded training, predicted from a model's parameter shapes (no process group).

The prediction follows the engine's layout exactly (see [Note: dim-0 layout] in ``engine/layout.py`` and
[Note: group buffers] in ``engine/group.py``). For a unit (a module the auto-wrap policy selects, plus the root
for what is left) sharded over ``S`` ranks, with ``s_i`` the padded shard size of parameter ``i`` and
``G = sum(s_i)``:

- parameters: the flat shard, ``G`` elements in the parameter dtype;
- gradients: the reduced shard, ``G`` elements in the parameter dtype;
- optimizer states (Adam): two tensors per parameter shaped like its real rows on rank 0 (the rank holding the
  most), plus a 4-byte step per parameter;
- gathered parameters: ``S * G`` elements in the compute dtype per unit gathered at once. ``largest_unit`` is
  the biggest single unit; ``gathered`` is the peak: the root (kept gathered through forward and backward)
  plus the largest other unit for FULL_SHARD / HYBRID_SHARD (the others are freed after use), every unit for
  SHARD_GRAD_OP (kept from forward until backward ends). NO_SHARD in full precision gathers nothing: the
  gathered buffer is the shard itself.

``S`` is the world size (FULL_SHARD, SHARD_GRAD_OP), 1 (NO_SHARD) or the ranks per machine (hybrid).
With ``cpu_offload`` the parameters, gradients and optimizer states live in CPU memory: they are reported,
but not in the device total nor in the peak.

The peak of a training step (``MemoryEstimate.peak``, what ``estimate-memory`` prints) is the larger of two
moments; ``zero_grad()`` frees the sharded gradients between steps, and backward turns activations into
gradients, so the sum of the two is linear through backward and its maximum is at one end:
- backward's start: parameters + Adam states + every activation (:mod:`fullshard.cli.activations`) +
  the root and the last unit gathered with the next one prefetched (``units_in_flight``; every unit for
  SHARD_GRAD_OP, which keeps them from forward to backward);
- backward's end: parameters + gradients + Adam states + the root and one unit gathered + that unit's
  full-size gradient twice (autograd's per-parameter gradients and the flat reduce-scatter input).
Both add ``baseline``: the process's RSS besides tensors (interpreter, torch, the process group), measured.
This is what the engine should hold; ``docs/benchmarks.md`` puts it beside measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fullshard.cli.activations import ActivationProfile, profile_activations
from fullshard.engine import ModuleWrapPolicy, ShardingStrategy, ShardLayout, plan_units

__all__ = ["MemoryEstimate", "estimate_memory", "find_unit_classes", "unit_parameters"]

_COMPUTE_BYTES = {"no": None, "fp32": None, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds (rank 0, which holds the most) for one sharding strategy.

    ``params``, ``grads``, ``optimizer`` and ``gathered`` are the model state (``device_total``); ``peak`` is
    the whole process at its fullest moment of a step (see the module docstring): ``baseline`` plus the state
    plus, at whichever of the two candidate moments is larger (``peak_phase``), the gathered units, the
    activations and the full-size gradient buffer.
    """

    strategy: ShardingStrategy
    num_processes: int
    shard_size: int
    params: int
    grads: int
    optimizer: int
    gathered: int
    largest_unit: int
    cpu_offload: bool = False
    activations: int = 0
    grad_buffer: int = 0
    baseline: int = 0
    peak: int = 0
    peak_phase: str = ""

    @property
    def device_total(self) -> int:
        """Bytes on the compute device: everything, minus what ``cpu_offload`` keeps on the CPU."""
        kept = 0 if self.cpu_offload else self.params + self.grads + self.optimizer
        return kept + self.gathered


def find_unit_classes(model: nn.Module, names: list[str] | None) -> set[type[nn.Module]]:
    """The classes named ``names`` (default: ``model._no_split_modules``) among ``model``'s modules."""
    names = names if names is not None else list(getattr(model, "_no_split_modules", None) or [])
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(
            f"unit classes {missing}: not found in {type(model).__name__}. Its module classes are: "
            f"{', '.join(sorted(by_name))}."
        )
    return {by_name[n] for n in names}


def unit_parameters(model: nn.Module, unit_classes: set[type[nn.Module]]) -> list[list[nn.Parameter]]:
    """The parameters of each unit, innermost first and the root last (tied parameters counted once)."""
    policy = ModuleWrapPolicy(unit_classes) if unit_classes else None
    modules = [p.module for p in plan_units(model, policy)] + [model]
    seen: set[int] = set()
    units = []
    for module in modules:
        params = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        units.append(params)
    return units


def _shard_size(strategy: ShardingStrategy, num_processes: int, num_machines: int) -> int:
    if strategy is ShardingStrategy.NO_SHARD:
        return 1
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        if num_processes % num_machines:
            raise ValueError(
                f"num_processes={num_processes} with num_machines={num_machines}: hybrid sharding needs the same "
                "number of processes on every machine. Pass a multiple of num_machines."
            )
        return num_processes // num_machines
    return num_processes


def estimate_memory(
    units: list[list[nn.Parameter]],
    num_processes: int,
    strategy: ShardingStrategy,
    *,
    mixed_precision: str = "no",
    cpu_offload: bool = False,
    num_machines: int = 1,
    activations: ActivationProfile | None = None,
    checkpointing: bool = False,
    baseline: int = 0,
    units_in_flight: int = 2,
) -> MemoryEstimate:
    """Predicted bytes on rank 0 for ``units`` (from :func:`unit_parameters`); see the module docstring."""
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes}: expected at least 1 process.")
    if mixed_precision not in _COMPUTE_BYTES:
        raise ValueError(f"mixed_precision={mixed_precision!r}: expected one of {', '.join(_COMPUTE_BYTES)}.")
    if units_in_flight not in (1, 2):
        raise ValueError(f"units_in_flight={units_in_flight}: expected 1 (no prefetch) or 2 (backward prefetch).")
    size = _shard_size(strategy, num_processes, num_machines)
    params = optimizer = 0
    unit_full: list[int] = []
    for unit in units:
        shard_numel = 0
        for p in unit:
            layout = ShardLayout(tuple(p.shape), size, 0)
            shard_numel += layout.padded_shard_numel
            optimizer += 2 * layout.local_numel * p.element_size() + 4
        elem = unit[0].element_size() if unit else 4
        params += shard_numel * elem
        compute = _COMPUTE_BYTES[mixed_precision] or elem
        cast = compute != elem
        unit_full.append(size * shard_numel * compute if (size > 1 or cast) else 0)
    keep_all = strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)
    root, blocks = unit_full[-1], unit_full[:-1]
    largest_block = max(blocks, default=0)
    in_flight = min(units_in_flight, len(blocks)) * largest_block
    gathered = sum(unit_full) if keep_all else root + largest_block
    # The two fullest moments of a step (gradients are freed by zero_grad(), so they are absent at the first):
    # backward's start, every activation alive, and backward's end, every sharded gradient alive.
    # A unit's full-size gradient twice: autograd's per-parameter gradients and the flat reduce-scatter input
    # they are copied into (with one rank there is no reduce-scatter, and the gradients land in the shard).
    grad_buffer = 2 * largest_block if size > 1 else 0
    acts = activations.peak(checkpointing) if activations is not None else 0
    state = 0 if cpu_offload else params + optimizer
    grads = 0 if cpu_offload else params
    at_backward_start = state + acts + (sum(unit_full) if keep_all else root + in_flight)
    at_backward_end = state + grads + root + largest_block + grad_buffer
    phase = "backward start" if at_backward_start > at_backward_end else "backward end"
    return MemoryEstimate(
        strategy,
        num_processes,
        size,
        params,
        params,
        optimizer,
        gathered,
        max(unit_full, default=0),
        cpu_offload,
        activations=acts,
        grad_buffer=grad_buffer,
        baseline=baseline,
        peak=baseline + max(at_backward_start, at_backward_end),
        peak_phase=phase,
    )


# RSS of a rank before its model exists: the interpreter, torch, fullshard and a gloo process group, plus what
# the first step adds outside tensors (autograd engine, kernels' thread pools). Measured with
# benchmarks/train.py peak on torch 2.13 CPU (docs/benchmarks.md, "estimate-memory against measured peaks").
PROCESS_BASELINE = 360 * 2**20


def vocab_size_of(model: nn.Module) -> int | None:
    """The vocabulary of a language model (``config.vocab_size`` of Hugging Face models, ``cfg`` of ours)."""
    config = getattr(model, "config", None) or getattr(model, "cfg", None)
    return getattr(config, "vocab_size", None)


def profile_training(
    model: nn.Module, unit_classes: set[type[nn.Module]], *, batch: int, seq: int
) -> tuple[list[list[nn.Parameter]], ActivationProfile]:
    """The units of the meta-device ``model`` and its activation profile for ``batch`` x ``seq`` tokens."""
    policy = ModuleWrapPolicy(unit_classes) if unit_classes else None
    modules = [p.module for p in plan_units(model, policy)]
    return unit_parameters(model, unit_classes), profile_activations(model, modules, batch, seq, vocab_size_of(model))


def estimate_training(
    model: nn.Module,
    unit_classes: set[type[nn.Module]],
    num_processes: int,
    strategy: ShardingStrategy,
    *,
    batch: int,
    seq: int,
    checkpointing: bool = False,
    baseline: int = PROCESS_BASELINE,
    **options: object,
) -> MemoryEstimate:
    """Peak bytes per rank of training the meta-device ``model`` on ``batch`` sequences of ``seq`` tokens."""
    units, profile = profile_training(model, unit_classes, batch=batch, seq=seq)
    return estimate_memory(
        units, num_processes, strategy, activations=profile, checkpointing=checkpointing, baseline=baseline,
        **options,  # type: ignore[arg-type]
    )  # fmt: skip

"""Per-step helpers of the ``Accelerator``: gradient sync on accumulation steps, clipping, autocast, metrics.

Kept apart from ``accelerator.py`` so that each piece is a small function with its own test.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from fullshard.engine import (
    FSDPModule,
    FullyShardedDataParallel,
    clip_module_grad_norm_,
    gradient_sync,
    local_tensor,
)
from fullshard.frontend import invariant, ops
from fullshard.frontend.compile import is_compiled_module
from fullshard.frontend.data.sharded_loader import GradientState
from fullshard.frontend.enums import PrecisionType

__all__ = [
    "clip_grad_value",
    "trigger_sync",
    "advance_step",
    "autocast_context",
    "clip_grad_norm",
    "extract_model_from_parallel",
    "no_sync",
    "needs_autocast",
    "truncate_for_metrics",
    "wrap_forward_for_precision",
]

_AUTOCAST_DTYPES = {PrecisionType.BF16: torch.bfloat16, PrecisionType.FP16: torch.float16}


def advance_step(state: GradientState) -> None:
    """Count one micro-batch; ``sync_gradients`` becomes ``True`` every ``num_steps`` and at the loader's end
    (unless ``sync_with_dataloader`` is off: then the count runs on across loaders)."""
    if state.end_of_dataloader and state.sync_with_dataloader:
        state.step = 0
        state.sync_gradients = True
        return
    state.step += 1
    state.sync_gradients = state.step % state.num_steps == 0


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Keep gradients local (unreduced) for the block: ``no_sync()`` (v1) or ``set_requires_gradient_sync`` (v2)."""
    if isinstance(model, FullyShardedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def clip_grad_norm(
    models: list[nn.Module], parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float
) -> torch.Tensor:
    """Clip to a global norm across shards when ``parameters`` are a prepared model's, else like torch does."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    wanted = {id(p) for p in params}
    for model in models:
        mine = {id(p) for p in model.parameters()}
        if wanted and wanted <= mine:
            if isinstance(model, FullyShardedDataParallel):
                return model.clip_grad_norm_(max_norm, norm_type)
            return clip_module_grad_norm_(model, max_norm, norm_type)
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)


def autocast_context(
    precision: PrecisionType, device: torch.device, handler: Any = None
) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` in the run's precision (a no-op context for full precision), with an ``AutocastKwargs``'
    ``enabled`` / ``cache_enabled`` when one is given."""
    if precision is PrecisionType.NO:
        return contextlib.nullcontext()
    options = handler.to_kwargs() if handler is not None else {}
    return torch.autocast(device_type=device.type, dtype=_AUTOCAST_DTYPES[precision], **options)


def needs_autocast(precision: PrecisionType, policy: object) -> bool:
    """Whether the forward must also run under ``torch.autocast`` for the run's ``precision``.

    Not when the engine's mixed precision policy sets ``param_dtype``: every gathered parameter is then already in
    that dtype and the root's floating-point inputs are cast to it, so the forward computes in low precision
    without autocast. Autocast on top would re-cast per op and, unlike the policy, keep some ops in float32
    (which ops depends on the device), so the run would no longer be "the model cast to ``param_dtype``" that
    the parity tests compare against. A policy without ``param_dtype`` (e.g. only ``reduce_dtype``) computes in
    full precision, so there autocast is what makes the Accelerator's ``mixed_precision`` take effect.
    """
    return precision is not PrecisionType.NO and getattr(policy, "param_dtype", None) is None


def wrap_forward_for_precision(
    model: nn.Module, precision: PrecisionType, device: torch.device, *, autocast: bool, handler: Any = None
) -> None:
    """Return float32 outputs from ``model``'s forward (Accelerate's mixed precision), under autocast if asked.

    Nothing changes in full precision. The original forward stays reachable as ``model.forward.__wrapped__``
    (``unwrap_model(keep_fp32_wrapper=False)`` restores it).
    """
    if precision is PrecisionType.NO:
        return
    forward: Callable[..., Any] = model.forward
    context = autocast_context if autocast else (lambda *_: contextlib.nullcontext())

    @functools.wraps(forward)
    def forward_in_precision(*args: Any, **kwargs: Any) -> Any:
        with context(precision, device, handler):
            output = forward(*args, **kwargs)
        return ops.convert_to_fp32(output)

    model.forward = forward_in_precision  # type: ignore[method-assign]


def extract_model_from_parallel(
    model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool | None = True, **_: Any
) -> nn.Module:
    """The user's module: the one a ``FullyShardedDataParallel`` (or DDP, ``DataParallel``) wraps; ``fully_shard``
    modules are themselves.

    A ``torch.compile(wrapper)`` (an ``OptimizedModule``) is looked through: without ``keep_torch_compile`` the
    module inside the wrappers is returned; with it, that module compiled with the same settings (a new
    ``OptimizedModule``, so the one given keeps calling its wrapper), as Accelerate's ``keep_torch_compile``.
    Without ``keep_fp32_wrapper`` the autocast wrapper of mixed precision is removed from ``forward``.
    """
    compiled = model if is_compiled_module(model) else None
    if compiled is not None:
        model = compiled._orig_mod
    while isinstance(model, (FullyShardedDataParallel, nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    patched = model.__dict__.get("forward")
    if not keep_fp32_wrapper and patched is not None and hasattr(patched, "__wrapped__"):
        original = patched.__wrapped__
        if getattr(original, "__func__", None) is type(model).forward:
            del model.forward  # back to the class's method
        else:
            model.forward = original  # type: ignore[method-assign]
    if keep_torch_compile and compiled is not None:
        if compiled._orig_mod is model:
            return compiled
        return type(compiled)(model, compiled.dynamo_ctx)
    return model


def truncate_for_metrics(data: Any, state: GradientState, *, objects: bool) -> Any:
    """Drop the padding samples of the last global batch (see [Note: batch dealing] in ``data/sharded_loader.py``; in
    world-size-invariant mode they are spread over the last ``G/N`` batches of every rank: ``metric_rows``)."""
    if state.metric_rows is not None:
        return invariant.keep_rows(data, state.metric_rows, objects=objects)
    if not state.end_of_dataloader or state.remainder <= 0:
        return data
    if objects:
        return data[: state.remainder]
    return ops.recursively_apply(lambda t: t[: state.remainder], data)


# --- forcing a reduction, clipping by value --------------------------------------------------------
# Gradient helpers of the ``Accelerator`` beyond ``training.py``: forcing a reduction, clipping by value.
#
# - :func:`trigger_sync`: inside ``no_sync`` (or an accumulation step of ``accumulate``), the backward run in
#   this block reduces gradients anyway, as Accelerate's ``trigger_sync_in_backward`` does for DDP. Under FSDP
#   Accelerate does nothing there; here every unit of the model reduces in that backward, so a loop that must
#   synchronise on a step of its choosing (e.g. before an evaluation) can.
# - :func:`clip_grad_value`: clamp every gradient element into ``[-clip_value, clip_value]``. The clamp is
#   elementwise, so clamping each rank's shard equals clamping the full gradient: no communication is needed.
#   (Accelerate refuses ``clip_grad_value_`` under FSDP; fullshard can do it exactly.)


def trigger_sync(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Reduce ``model``'s gradients in the backward run inside this block, whatever ``no_sync`` says outside it."""
    return gradient_sync(model, True)


def clip_grad_value(parameters: Iterable[torch.Tensor] | torch.Tensor, clip_value: float) -> None:
    """Clamp the gradients of ``parameters`` in place (this rank's shard of each); see the module docstring."""
    if not isinstance(clip_value, (int, float)) or isinstance(clip_value, bool) or clip_value < 0:
        raise ValueError(f"clip_grad_value_(clip_value={clip_value!r}): expected a number >= 0.")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for p in params:
        if p.grad is not None:
            local_tensor(p.grad).clamp_(min=-clip_value, max=clip_value)

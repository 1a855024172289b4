"""The Accelerator's training-step methods: ``backward``, ``accumulate``, ``no_sync``, clipping, ``autocast``,
``join_uneven_inputs`` and ``profile``.

The Accelerator mixes in :class:`TrainingStep`; the work is ``training.py``'s (and ``invariant.py``'s loss division,
``handlers/profiling.py``'s profiler). Invariants: every gradient a step sees went through :meth:`backward`'s one
division (by the accumulation steps, or world-size-invariant mode's divisor) and the fp16 loss scale; gradients are
unscaled at most once per optimizer step, and never on an accumulation step; ``_accumulating`` is true exactly
inside :meth:`accumulate`'s block. The class reads, and does not set up, the Accelerator's ``gradient_state``,
``_objects``, ``_handlers``, ``_invariant``, ``mixed_precision``, ``device`` and process fields.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from fullshard.algorithms.grad_scaler import ShardedGradScaler
from fullshard.frontend import invariant, training
from fullshard.frontend.enums import PrecisionType
from fullshard.frontend.handlers import AutocastKwargs, ProfileKwargs, profiling
from fullshard.frontend.optim import AcceleratedOptimizer

__all__ = ["TrainingStep"]


class TrainingStep:
    """The Accelerator's per-step methods and the step's state it answers; see the module docstring."""

    @property
    def sync_gradients(self) -> bool:
        """Whether this step reduces gradients and steps the optimizer (``False`` on accumulation steps)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state._set_sync_gradients(value)

    @property
    def scaler(self) -> ShardedGradScaler | None:
        """The fp16 loss scaler (``None`` unless ``mixed_precision="fp16"``)."""
        return self._objects.scaler

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in self._objects.optimizers)

    # --- training step ----------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by ``1 / gradient_accumulation_steps`` (and the fp16 loss scale).

        World-size-invariant mode: outside ``accumulate()`` with ``G/N > 1`` only in a loop that announces its
        micro-batches (transformers' Trainer), and scaled by the steps the Accelerator was created with; see
        [Note: the Trainer in invariant mode] in ``invariant.py``.
        """
        steps = invariant.loss_divisor(
            self._invariant, self.gradient_accumulation_steps, self._accumulating, self.gradient_state.caller_steps
        )
        loss = loss / steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Divide the gradients by the fp16 loss scale (a no-op otherwise); at most once per optimizer step.

        Skipped on accumulation steps: the gradients are incomplete, and the next backward would add scaled
        values to unscaled ones.
        """
        if self.scaler is None or not self.sync_gradients:
            return
        optimizers = self._objects.optimizers if optimizer is None else [optimizer]
        for opt in optimizers:
            self.scaler.unscale_(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-batch: no gradient reduction unless it completes an accumulation step (or the loader)."""
        training.advance_step(self.gradient_state)
        with contextlib.ExitStack() as stack:
            if not (self.sync_gradients or (self.gradient_state.sync_each_batch and self.use_distributed)):
                for model in models:
                    stack.enter_context(training.no_sync(model))
            self._accumulating = True
            stack.callback(setattr, self, "_accumulating", False)
            yield

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return training.no_sync(model)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip gradients to a global norm over all shards; returns the norm before clipping (equal on all ranks).

        With fp16 the gradients are unscaled first, so ``max_norm`` applies to the true gradients.
        """
        self.unscale_gradients()
        return training.clip_grad_norm(self._objects.models, parameters, max_norm, norm_type)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` in the run's mixed precision; ``autocast_handler`` (else the Accelerator's
        ``AutocastKwargs``) sets its ``enabled`` and ``cache_enabled``."""
        handler = autocast_handler if autocast_handler is not None else self._handlers.autocast
        return training.autocast_context(PrecisionType(self.mixed_precision), self.device, handler)

    def trigger_sync_in_backward(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return training.trigger_sync(model)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, clip_value: float) -> None:
        """Clamp gradients into ``[-clip_value, clip_value]`` (after fp16 unscaling); exact on shards."""
        self.unscale_gradients()
        training.clip_grad_value(parameters, clip_value)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Run the block with the prepared loaders' ``even_batches`` set to ``even_batches`` (if given).

        A sharded model cannot "join": every forward and backward is a collective, so a rank that ran out of
        batches would leave the others waiting. Uneven batches on several processes are therefore refused.
        """
        del joinables
        if even_batches is False and self.num_processes > 1:
            raise ValueError(
                "Accelerator.join_uneven_inputs(even_batches=False): a sharded model cannot run uneven batches "
                "(each forward/backward is a collective every rank must join). Keep even_batches=True."
            )
        samplers = [dl.batch_sampler for dl in self._objects.dataloaders if hasattr(dl.batch_sampler, "even_batches")]
        previous = [s.even_batches for s in samplers]
        for sampler in samplers if even_batches is not None else []:
            sampler.even_batches = even_batches
        try:
            yield
        finally:
            for sampler, value in zip(samplers, previous):
                sampler.even_batches = value

    def profile(self, profile_handler: ProfileKwargs | None = None) -> contextlib.AbstractContextManager[Any]:
        """``torch.profiler`` over the block; traces go to ``output_trace_dir`` (see ``handlers/profiling.py``)."""
        handler = profile_handler or self._handlers.profile
        return profiling.profile(handler, self.process_index, self.wait_for_everyone)

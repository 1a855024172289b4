"""The optimizer and LR scheduler wrappers ``Accelerator.prepare`` returns.

Both consult the shared :class:`~fullshard.frontend.data.gradient_state.GradientState`: on an accumulation step
(``sync_gradients`` is ``False``) ``optimizer.step()``, ``optimizer.zero_grad()`` and ``scheduler.step()`` do
nothing, so a loop written for one step per batch accumulates without change.

With float16 mixed precision the optimizer steps through the run's ``ShardedGradScaler``: the step is skipped
on every rank when any rank's gradient shard holds an inf or nan, the scale is lowered, and the scheduler does
not advance for that step (as in Accelerate, ``scaler.update()`` follows each optimizer's step).

As in Accelerate, one scheduler step advances the wrapped scheduler once per process: a schedule written for
the batches of the whole dataset stays on time when every step consumes ``num_processes`` batches. With
``split_batches`` a step consumes one original batch, and the Accelerator passes ``num_processes=1``.
"""

from __future__ import annotations

from typing import Any

import torch

from fullshard.algorithms.grad_scaler import ShardedGradScaler
from fullshard.frontend.data.sharded_loader import GradientState

__all__ = ["AcceleratedOptimizer", "AcceleratedScheduler"]


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Delegates to ``optimizer``; ``step`` and ``zero_grad`` only act when gradients are synchronised."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_state: GradientState,
        scaler: ShardedGradScaler | None = None,
    ) -> None:
        # No super().__init__: the wrapped optimizer owns param_groups, state and defaults.
        self.optimizer = optimizer
        self.gradient_state = gradient_state
        self.scaler = scaler
        self._is_overflow = False

    def __getstate__(self) -> dict[str, Any]:  # torch's Optimizer pickles only its own three fields
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` call did nothing: an accumulation step, or an fp16 overflow."""
        return self._is_overflow

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self._is_overflow = not self.gradient_state.sync_gradients
        if self._is_overflow:
            return None
        if self.scaler is None:
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        return self._scaled_step(self.scaler, closure)

    def _scaled_step(self, scaler: ShardedGradScaler, closure: Any) -> Any:
        """Step through the scaler. The scale only ever drops (by ``backoff_factor`` < 1) when an inf or nan was
        found, and that finding is agreed by all ranks, so a lower scale after ``update()`` means "skipped"."""
        scale = scaler.get_scale()
        result = scaler.step(self.optimizer, closure) if closure is not None else scaler.step(self.optimizer)
        scaler.update()
        self._is_overflow = scaler.get_scale() < scale
        return result

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


class AcceleratedScheduler:
    """Delegates to ``scheduler``; ``step`` advances it ``num_processes`` times on synchronised steps only."""

    def __init__(
        self,
        scheduler: Any,
        optimizers: list[AcceleratedOptimizer],
        gradient_state: GradientState,
        num_processes: int,
        step_with_optimizer: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.num_processes = num_processes
        self.step_with_optimizer = step_with_optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(self.num_processes):
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

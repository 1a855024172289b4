"""``GradientState``: what the Accelerator, its optimizers, schedulers and loaders share about the current step.

Its own module so that both the Accelerator's loaders (``sharded_loader.py``) and Accelerate's loader classes
(``loader_parts.py``) can use it, and the first can be a kind of the second.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fullshard.frontend.invariant import CallerSteps

__all__ = ["GradientState"]


class GradientState:
    """What the prepared objects share about the current step (Accelerate's ``GradientState``), one per process.

    Like Accelerate's, every instance shares one state: ``GradientState()`` with no argument is the state the
    Accelerator and its loaders use (``accelerator.gradient_accumulation_steps = 4`` shows as ``num_steps`` there),
    and ``_reset_state()`` forgets it. Given fields (as the ``Accelerator`` gives them when it is built), the shared
    state starts over from the defaults plus those fields; ``gradient_accumulation_plugin=`` sets the step count and
    the switches from a ``GradientAccumulationPlugin``, as in Accelerate.

    - ``sync_gradients``: this step reduces gradients and the optimizer steps (not an accumulation step).
    - ``end_of_dataloader``: the batch being processed is the last of the active prepared loader.
    - ``remainder``: real samples in that last global batch (``-1``: unknown or none padded).
    - ``metric_rows``: world-size-invariant mode, a batch of a padded last global batch: each rank's number of
      real samples in its current batch (``None`` otherwise); ``gather_for_metrics`` keeps those.
    - ``sync_with_dataloader``, ``sync_each_batch``, ``adjust_scheduler``: a ``GradientAccumulationPlugin``'s
      switches (see ``handlers/grad.py``).
    - ``caller_steps``: world-size-invariant mode, the micro-batches of a loop that accumulates itself (see
      [Note: the Trainer in invariant mode] in ``invariant.py``); ``None`` in the default mode.
    """

    _shared_state: ClassVar[dict[str, Any]] = {}
    _DEFAULTS: ClassVar[dict[str, Any]] = {
        "num_steps": 1, "sync_gradients": True, "end_of_dataloader": False, "remainder": -1, "metric_rows": None,
        "step": 0, "sync_with_dataloader": True, "sync_each_batch": False, "adjust_scheduler": True,
        "caller_steps": None,
    }  # fmt: skip

    num_steps: int
    sync_gradients: bool
    end_of_dataloader: bool
    remainder: int
    metric_rows: tuple[int, ...] | None
    step: int
    sync_with_dataloader: bool
    sync_each_batch: bool
    adjust_scheduler: bool
    caller_steps: CallerSteps | None

    def __init__(self, gradient_accumulation_plugin: Any = None, **fields: Any) -> None:
        unknown = sorted(set(fields) - set(self._DEFAULTS))
        if unknown:
            raise TypeError(f"GradientState({unknown[0]}=...): not a field; the fields are {sorted(self._DEFAULTS)}.")
        self.__dict__ = GradientState._shared_state
        if fields or not self.__dict__:
            self.__dict__.clear()
            self.__dict__.update(self._DEFAULTS, **fields)
        if gradient_accumulation_plugin is not None:
            plugin = gradient_accumulation_plugin
            self.num_steps = plugin.num_steps
            for name in ("sync_with_dataloader", "sync_each_batch", "adjust_scheduler"):
                setattr(self, name, getattr(plugin, name))

    @staticmethod
    def _reset_state() -> None:
        """Forget the shared state: the next ``GradientState()`` starts from the defaults."""
        GradientState._shared_state.clear()

    @property
    def initialized(self) -> bool:
        return bool(self.__dict__)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={self.__dict__.get(k)!r}" for k in self._DEFAULTS)
        return f"GradientState({fields})"

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Accelerate's setter, which transformers' Trainer calls before each micro-batch (it accumulates gradients
        itself); in world-size-invariant mode it also checks the step's length and seeds the micro-batch's RNG."""
        if self.caller_steps is not None:
            self.caller_steps.announce(sync_gradients)
        self.sync_gradients = sync_gradients

    def _set_end_of_dataloader(self, end_of_dataloader: bool) -> None:
        self.end_of_dataloader = end_of_dataloader

    def _set_remainder(self, remainder: int) -> None:
        self.remainder = remainder

    @property
    def plugin_kwargs(self) -> dict[str, bool]:
        """The ``GradientAccumulationPlugin`` switches, by name, as Accelerate's ``GradientState`` keeps them."""
        return {"sync_with_dataloader": self.sync_with_dataloader, "sync_each_batch": self.sync_each_batch,
                "adjust_scheduler": self.adjust_scheduler}  # fmt: skip

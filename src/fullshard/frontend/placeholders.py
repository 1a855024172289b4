"""Placeholders for objects a DeepSpeed or Megatron-LM config defines: :class:`DummyOptim`, :class:`DummyScheduler`,
:class:`MegatronLMDummyScheduler`.

Scripts written for Accelerate import them and build them only when such a plugin is active
(``accelerator.state.deepspeed_plugin`` is ``None`` here); building one raises, naming what to build instead.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DummyOptim", "DummyScheduler", "MegatronLMDummyScheduler"]


class _ForeignPlaceholder:
    """Refuses to be built: the plugin that would fill it in does not exist in fullshard."""

    _plugin = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        raise RuntimeError(
            f"{name}(...): a placeholder for an object a {self._plugin} config defines; fullshard has no "
            f"{self._plugin} plugin (accelerator.state.deepspeed_plugin is None). Build a torch optimizer or "
            "scheduler instead, as the script does when no such plugin is active."
        )


class DummyOptim(_ForeignPlaceholder):
    _plugin = "DeepSpeed"


class DummyScheduler(_ForeignPlaceholder):
    _plugin = "DeepSpeed"


class MegatronLMDummyScheduler(_ForeignPlaceholder):
    _plugin = "Megatron-LM"

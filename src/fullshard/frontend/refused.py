"""Names of Accelerate's API that exist only so that an ``import`` succeeds: using one raises, naming it.

A library written for Accelerate imports some names at module level that it uses only for DeepSpeed, XLA,
Megatron-LM, tensor parallelism or device maps (transformers imports ``dispatch_model`` and
``DeepSpeedSchedulerWrapper`` that way). :func:`refused_function` and :func:`refused_class` build stand-ins
that import like the real thing and raise ``NotImplementedError`` with the name and the reason when called
or built. :class:`DummyOptim`, :class:`DummyScheduler` and :class:`MegatronLMDummyScheduler` are the placeholders a
DeepSpeed or Megatron-LM config defines: scripts import them and build them only when such a plugin is active
(``accelerator.state.deepspeed_plugin`` is ``None`` here); building one raises, naming what to build instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["DummyOptim", "DummyScheduler", "MegatronLMDummyScheduler", "refused_class", "refused_function"]


def _refuse(name: str, why: str) -> NoReturn:
    raise NotImplementedError(f"accelerate's {name} is not provided by fullshard: {why}.")


def refused_function(name: str, why: str) -> Callable[..., NoReturn]:
    """A function named ``name`` that raises ``NotImplementedError`` saying ``why`` when called."""

    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        del args, kwargs
        _refuse(name, why)

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Not provided by fullshard ({why}); calling it raises NotImplementedError."
    return refused


def refused_class(name: str, why: str) -> type:
    """A class named ``name`` whose construction raises ``NotImplementedError`` saying ``why``."""

    def init(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        del self, args, kwargs
        _refuse(name, why)

    doc = f"Not provided by fullshard ({why}); building one raises NotImplementedError."
    return type(name, (), {"__init__": init, "__doc__": doc, "__module__": __name__})


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

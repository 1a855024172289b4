"""``torch.compile`` through the Accelerator: ``TorchDynamoPlugin``, ``dynamo_backend=`` and the launcher's
``ACCELERATE_DYNAMO_*`` variables, as Accelerate 1.15 takes them.

Unset fields are read from the ``ACCELERATE_DYNAMO_*`` variables of ``env.DYNAMO_VARS``. The model is compiled
after it is sharded, in place (``module.compile()``): the engine's forward hooks are disabled for dynamo (see
[Note: hooks outside compiled graphs] in ``engine/unit_state.py``), so they run eagerly between compiled graphs, and
the prepared model stays the object the rest of the front end knows (its state dict, ``unwrap_model``,
``save_model``). Accelerate's FSDP2 path returns an ``OptimizedModule`` for a whole-model compile instead; here
``model._orig_mod`` does not exist and ``model.forward`` is the original one.

With ``use_regional_compilation`` every run of repeated blocks (an ``nn.ModuleList`` whose children share one
class) has each block compiled with the same arguments, so dynamo compiles the block's code once and reuses it
for the others; every other leaf child is compiled on its own, as Accelerate does.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from typing import Any

import torch
from torch import nn

from fullshard.frontend.enums import DynamoBackend
from fullshard.frontend.env import DYNAMO_MODES, read_dynamo_env

__all__ = [
    "TorchDynamoPlugin",
    "compile_model",
    "compile_regions",
    "compile_regions_fsdp2",
    "has_compiled_regions",
    "is_compiled_module",
    "resolve_dynamo_plugin",
]


@dataclasses.dataclass
class TorchDynamoPlugin:
    """How the Accelerator compiles the prepared model; unset fields come from ``ACCELERATE_DYNAMO_*``.

    ``backend="no"`` (the default) compiles nothing. ``options`` go to the backend; ``disable=True`` makes the
    compile a no-op (for testing).
    """

    backend: DynamoBackend | str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        from_env = read_dynamo_env()
        backend = self.backend if self.backend is not None else from_env.get("backend", "no")
        text = str(getattr(backend, "value", backend)).strip().upper()
        if text not in DynamoBackend:
            raise ValueError(
                f"TorchDynamoPlugin(backend={backend!r}): not a torch.compile backend name. Use one of "
                f"{', '.join(b.lower() for b in DynamoBackend.list())} (e.g. 'inductor'), or 'no' to not compile."
            )
        self.backend = DynamoBackend(text)
        self.mode = self.mode if self.mode is not None else from_env.get("mode", "default")
        if self.mode not in DYNAMO_MODES:
            raise ValueError(f"TorchDynamoPlugin(mode={self.mode!r}): use one of {', '.join(DYNAMO_MODES)}.")
        for name in ("fullgraph", "use_regional_compilation"):
            if getattr(self, name) is None:
                setattr(self, name, from_env.get(name, False))
        if self.dynamic is None:
            self.dynamic = from_env.get("dynamic")

    @property
    def enabled(self) -> bool:
        return self.backend is not DynamoBackend.NO

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["backend"] = self.backend.value.lower()
        return data

    def to_kwargs(self) -> dict[str, Any]:
        """The ``torch.compile`` keyword arguments (``use_regional_compilation`` is ours, not torch's)."""
        kwargs = {"backend": self.backend.value.lower(), "mode": self.mode}
        if self.fullgraph:  # torch.compile's default is False: written only when asked for, as Accelerate does
            kwargs["fullgraph"] = True
        kwargs.update({k: v for k, v in (("dynamic", self.dynamic), ("options", self.options)) if v is not None})
        if self.disable:
            kwargs["disable"] = True
        if kwargs.get("options") is not None:
            kwargs.pop("mode")  # torch.compile takes one of mode and options
        return kwargs


def resolve_dynamo_plugin(dynamo_backend: Any, dynamo_plugin: TorchDynamoPlugin | None) -> TorchDynamoPlugin:
    """``Accelerator(dynamo_backend=..., dynamo_plugin=...)`` to one plugin (both at once is refused)."""
    if dynamo_backend is not None and dynamo_plugin is not None:
        raise ValueError(
            "Accelerator(dynamo_backend=..., dynamo_plugin=...): pass one of them; the plugin's backend field "
            "names the backend."
        )
    if dynamo_plugin is not None:
        if not isinstance(dynamo_plugin, TorchDynamoPlugin):
            raise TypeError(
                f"Accelerator(dynamo_plugin={type(dynamo_plugin).__name__}): expected a TorchDynamoPlugin "
                "(from fullshard.utils import TorchDynamoPlugin)."
            )
        return dynamo_plugin
    return TorchDynamoPlugin(backend=dynamo_backend)


def compile_model(model: nn.Module, plugin: TorchDynamoPlugin) -> nn.Module:
    """Compile the sharded ``model`` in place as ``plugin`` says; returns ``model``."""
    if not plugin.enabled or getattr(model, "_compiled_call_impl", None) is not None:
        return model
    kwargs = plugin.to_kwargs()
    if plugin.use_regional_compilation:
        _compile_regions(model, kwargs)
    else:
        model.compile(**kwargs)
    return model


def _is_repeated_blocks(module: nn.Module) -> bool:
    return isinstance(module, nn.ModuleList) and len(module) > 0 and all(type(m) is type(module[0]) for m in module)


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (an ``OptimizedModule``). A model compiled in
    place (``module.compile()``, as the Accelerator compiles) is not: it is its own class, with a compiled call."""
    dynamo = getattr(torch, "_dynamo", None)
    return dynamo is not None and isinstance(module, dynamo.eval_frame.OptimizedModule)


def has_compiled_regions(module: nn.Module) -> bool:
    """Whether a submodule of ``module`` is an ``OptimizedModule`` (``torch.compile`` applied to a part)."""
    return bool(module._modules) and any(is_compiled_module(m) for m in module.modules())


def compile_regions(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """A copy of ``module``'s tree whose regions are ``torch.compile`` d: each block of a run of repeated blocks, and
    every leaf child outside such runs (Accelerate's ``compile_regions``). Parameters, buffers and the original
    modules are shared, not copied; the result keeps ``module`` as ``_orig_mod``."""
    compiled = _compiled_copy(module, compile_kwargs)
    compiled.__dict__.setdefault("_orig_mod", module)
    return compiled


def _compiled_copy(module: nn.Module, kwargs: dict[str, Any]) -> nn.Module:
    if _is_repeated_blocks(module):
        return nn.ModuleList(torch.compile(block, **kwargs) for block in module)
    if not any(_is_repeated_blocks(m) for m in module.modules()):
        return torch.compile(module, **kwargs)
    shell = copy.copy(module)  # the same parameters, buffers and hooks; its own children below
    for name, value in list(shell.__dict__.items()):  # methods bound to the original bind to the copy
        if isinstance(value, types.MethodType) and value.__self__ is module:
            shell.__dict__[name] = types.MethodType(value.__func__, shell)
    shell._modules = {name: _compiled_copy(child, kwargs) for name, child in module.named_children()}
    return shell


def compile_regions_fsdp2(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Compile ``module`` in place by regions (Accelerate's name for it): each block of a run of repeated blocks
    on its own (dynamo reuses the first block's code), every other leaf child whole; returns ``module``, whose
    hooks, sharded or not, keep running (``module.compile()`` keeps ``nn.Module.__call__``)."""
    _compile_regions(module, compile_kwargs)
    return module


def _compile_regions(module: nn.Module, kwargs: dict[str, Any]) -> None:
    if _is_repeated_blocks(module):
        for block in module:
            block.compile(**kwargs)
    elif any(_is_repeated_blocks(m) for m in module.modules()):
        for child in module.children():
            _compile_regions(child, kwargs)
    else:
        module.compile(**kwargs)

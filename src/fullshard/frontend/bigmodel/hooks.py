"""Taking Accelerate's forward hooks off a module (``remove_hook_from_module``, ``remove_hook_from_submodules``).

fullshard never attaches such hooks (``add_hook_to_module`` is refused), but PEFT and transformers call the
removers on models that a device map may have dispatched. A module carries a hook as Accelerate leaves it: the
hook object in ``_hf_hook`` and the class's forward saved in ``_old_forward``. Removing it calls the hook's
``detach_hook``, puts the saved forward back and drops the per-instance device methods Accelerate adds; a
module without a hook is returned unchanged.
"""

from __future__ import annotations

from torch import nn

__all__ = ["remove_hook_from_module", "remove_hook_from_submodules"]

# Methods Accelerate's dispatch overrides on the instance (to warn when a dispatched model is moved).
_INSTANCE_METHODS = ("to", "cuda", "npu", "xpu", "mlu", "sdaa", "musa")


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Take the hook off ``module`` (and off every descendant with ``recurse``); returns ``module``."""
    hook = module.__dict__.get("_hf_hook")
    if hook is not None:
        detach = getattr(hook, "detach_hook", None)
        if callable(detach):
            detach(module)
        del module.__dict__["_hf_hook"]
    if "_old_forward" in module.__dict__:
        module.forward = module.__dict__.pop("_old_forward")  # type: ignore[method-assign]
    for name in _INSTANCE_METHODS:
        module.__dict__.pop(name, None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Take the hooks off ``module`` and every module below it."""
    remove_hook_from_module(module, recurse=True)

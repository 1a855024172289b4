"""``accelerate.hooks``: imported by transformers and PEFT at module level for device maps, which fullshard does
not have: adding a hook is refused, removing one works (a module without a hook is left as it is)."""

from fullshard.frontend.bigmodel.hooks import remove_hook_from_module, remove_hook_from_submodules
from fullshard.frontend.refused import refused_class, refused_function

_WHY = "fullshard shards models across processes instead of dispatching them over devices with hooks"
ModelHook = refused_class("ModelHook", _WHY)
AlignDevicesHook = refused_class("AlignDevicesHook", _WHY)
add_hook_to_module = refused_function("add_hook_to_module", _WHY)
attach_align_device_hook = refused_function("attach_align_device_hook", _WHY)

__all__ = [
    "AlignDevicesHook",
    "ModelHook",
    "add_hook_to_module",
    "attach_align_device_hook",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]


"""``accelerate.hooks``: imported by transformers at module level for device maps, which fullshard does not have."""

from fullshard.frontend.refused import refused_class, refused_function

_WHY = "fullshard shards models across processes instead of dispatching them over devices with hooks"
ModelHook = refused_class("ModelHook", _WHY)
AlignDevicesHook = refused_class("AlignDevicesHook", _WHY)
add_hook_to_module = refused_function("add_hook_to_module", _WHY)
remove_hook_from_module = refused_function("remove_hook_from_module", _WHY)

__all__ = ["AlignDevicesHook", "ModelHook", "add_hook_to_module", "remove_hook_from_module"]


# --- added for Accelerate's own test files (NAME=mirror); kept apart from the names above -----------------------
attach_align_device_hook = refused_function("attach_align_device_hook", _WHY)
__all__ += ["attach_align_device_hook"]

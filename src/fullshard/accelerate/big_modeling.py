"""``accelerate.big_modeling``: empty-weight initialisation, ``cpu_offload_with_hook``; device maps and Accelerate's
dispatch and offload hooks are refused."""

from fullshard import init_empty_weights, load_checkpoint_in_model
from fullshard.frontend.bigmodel.cpu_hook import cpu_offload_with_hook
from fullshard.frontend.refused import refused_function

_WHY = "fullshard shards models across processes instead of dispatching them over devices"
cpu_offload = refused_function("cpu_offload", _WHY)
disk_offload = refused_function("disk_offload", _WHY)
dispatch_model = refused_function("dispatch_model", _WHY)
init_on_device = refused_function("init_on_device", _WHY)
load_checkpoint_and_dispatch = refused_function("load_checkpoint_and_dispatch", _WHY)

__all__ = [
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
]

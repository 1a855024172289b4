"""``import accelerate`` served by fullshard: modules at Accelerate's paths that re-export fullshard.

Layout rule: one module per Accelerate module that a library imports (``accelerate.state``,
``accelerate.utils.memory``, ...), holding re-exports only; code lives in ``fullshard.frontend`` and the public
``fullshard`` / ``fullshard.utils`` surfaces. Names Accelerate has for DeepSpeed, XLA, Megatron-LM, tensor
parallelism or device maps exist only where libraries import them unconditionally, and raise by name when used
(``fullshard.frontend.refused``).

These modules become ``accelerate`` under ``fullshard launch --as_accelerate`` or ``FULLSHARD_AS_ACCELERATE=1``
(see ``fullshard/cli/as_accelerate.py``); otherwise nothing imports them.
"""

from fullshard import (
    Accelerator,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    find_executable_batch_size,
    infer_auto_device_map,
    init_empty_weights,
    load_checkpoint_in_model,
    skip_first_batches,
    synchronize_rng_states,
)
from fullshard.accelerate.big_modeling import (
    cpu_offload,
    disk_offload,
    dispatch_model,
    init_on_device,
    load_checkpoint_and_dispatch,
)
from fullshard.accelerate.parallelism_config import ParallelismConfig
from fullshard.accelerate.state import AcceleratorState, GradientState, PartialState
from fullshard.accelerate.utils import DeepSpeedPlugin, is_rich_available
from fullshard.frontend.launch_helpers import debug_launcher
from fullshard.frontend.refused import refused_function

# The version libraries read (transformers accepts >= 1.1; some features ask for >= 1.12): Accelerate's API as
# of the release fullshard follows.
__version__ = "1.15.0"

notebook_launcher = refused_function("notebook_launcher", "start processes with fullshard launch")

__all__ = [
    "Accelerator",
    "AcceleratorState",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientState",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "PartialState",
    "ProfileKwargs",
    "cpu_offload",
    "debug_launcher",
    "disk_offload",
    "dispatch_model",
    "find_executable_batch_size",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "is_rich_available",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "skip_first_batches",
    "synchronize_rng_states",
]

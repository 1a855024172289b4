"""``accelerate.state``: the process-wide singletons and the gradient state."""

from fullshard import DistributedType
from fullshard.frontend.data.sharded_loader import GradientState
from fullshard.frontend.processes.shared_state import AcceleratorState, PartialState

__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState"]

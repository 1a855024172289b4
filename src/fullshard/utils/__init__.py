"""``fullshard.utils``: Accelerate-compatible utilities (re-exports only)."""

from fullshard.checkpoint import (
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    merge_fsdp_weights,
)

__all__ = [
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "RNG_STATE_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "merge_fsdp_weights",
]

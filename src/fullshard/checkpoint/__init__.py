"""On-disk formats: sharded DCP checkpoints (atomic save/load), weight export and the streaming merge."""

from fullshard.checkpoint.dcp import check_sharded, load_sharded, save_sharded
from fullshard.checkpoint.export import parse_size, save_weights
from fullshard.checkpoint.merge import merge_fsdp_weights
from fullshard.checkpoint.names import (
    FSDP_MODEL_NAME,
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    model_folder_name,
    optimizer_folder_name,
    rng_state_file_name,
    scheduler_file_name,
)

__all__ = [
    "FSDP_MODEL_NAME",
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "RNG_STATE_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "check_sharded",
    "load_sharded",
    "merge_fsdp_weights",
    "model_folder_name",
    "optimizer_folder_name",
    "parse_size",
    "rng_state_file_name",
    "save_sharded",
    "save_weights",
    "scheduler_file_name",
]

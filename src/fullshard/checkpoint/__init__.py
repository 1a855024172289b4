"""On-disk formats: sharded DCP checkpoints (atomic save/load), weight export and the streaming merge.

One owner per idea, and imports run one way, up these levels (a module imports only its level or lower ones;
``tests/unit/test_import_layers.py`` holds the table): names, errors, files, boundary (every file name and
suffix, every error class, how files are created, which files a folder may name) -> manifest, checksum,
safe_load, collective, background (async saves: host copies, a thread, their own process group) -> folder (what a
folder is, the one recorded-size check) -> reader, writer -> transaction (the one commit protocol), rotation ->
dcp, verify, merge, export. A new module goes on the lowest level whose modules it needs.
"""

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

"""On-disk formats: sharded DCP checkpoints (atomic save/load), weight export and the streaming merge.

Other packages import ``fullshard.checkpoint`` only through this surface (its ``__all__``; enforced by
``tests/unit/test_import_layers.py``): the names of a training folder, a training folder saved in one call
(:func:`save_folder`, :func:`start_save_folder`, given a :class:`TrainingFolder`: what goes into it), the checks
before a load (:func:`folder_for_load`, :func:`check_before_loading`, :func:`read_on_every_rank`), the sharded save
and load of one folder, the safe readers, rotation, verify, merge and export. The modules below never import this
surface.

One owner per idea, and imports run one way, up these levels (a module imports only its level or lower ones;
``tests/unit/test_import_layers.py`` holds the table): names, errors, files, boundary (every file name and
suffix, every error class, how files are created, which files a folder may name) -> manifest, checksum,
safe_load, agreement, background (async saves: host copies, a thread, their own process group) -> folder (what a
folder is, the one recorded-size check) -> reader, writer (the one "a data file is as long as its ``.metadata``
says" check is the reader's) -> transaction (the one commit protocol), rotation -> dcp, verify, merge, export,
load_check, training_save (a training folder in one call, over one transaction). A new module goes on the lowest
level whose modules it needs.

The names are imported on first use (PEP 562 ``__getattr__``; the table is the ``if TYPE_CHECKING:`` imports), so a
command that needs one name (``fullshard launch``'s) does not import the sharded save's DTensor.
"""

from typing import TYPE_CHECKING

from fullshard.surface import lazy_surface

if TYPE_CHECKING:  # the table of what is imported from where, read by lazy_surface: imported on first use
    from fullshard.checkpoint import background
    from fullshard.checkpoint.background import host_copy
    from fullshard.checkpoint.dcp import check_sharded, load_sharded, save_sharded
    from fullshard.checkpoint.errors import CheckpointBusyError, CheckpointDamagedError, CheckpointFileError
    from fullshard.checkpoint.export import TensorSpec, parse_size, plan_shards, save_weights
    from fullshard.checkpoint.files import NoSpaceError, free_bytes, new_folders, no_space_message, remove_new_folders
    from fullshard.checkpoint.folder import check_output_dir, is_complete_checkpoint
    from fullshard.checkpoint.load_check import check_before_loading, folder_for_load, read_on_every_rank
    from fullshard.checkpoint.manifest import read_manifest
    from fullshard.checkpoint.merge import merge_fsdp_weights
    from fullshard.checkpoint.names import (
        CHECKPOINT_MANIFEST,
        DCP_METADATA_FILE,
        FSDP_MODEL_NAME,
        MODEL_NAME,
        OPTIMIZER_NAME,
        RNG_STATE_NAME,
        SAFE_MODEL_NAME,
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        SAMPLER_NAME,
        SCALER_NAME,
        SCHEDULER_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
        custom_checkpoint_file_name,
        full_model_file_name,
        model_folder_name,
        optimizer_file_name,
        optimizer_folder_name,
        rng_state_file_name,
        sampler_file_name,
        scheduler_file_name,
        step_in_progress_file_name,
    )
    from fullshard.checkpoint.rotation import (
        CHECKPOINTS_FOLDER,
        checkpoint_folder,
        checkpoint_index,
        latest_checkpoint,
        prune_checkpoints,
    )
    from fullshard.checkpoint.safe_load import load_rng_file, load_small_file
    from fullshard.checkpoint.training_save import Part, TrainingFolder, save_folder, start_save_folder
    from fullshard.checkpoint.verify import verify_checkpoint
    from fullshard.checkpoint.writer import local_nbytes, save_file

__all__ = [
    "start_save_folder",
    "save_folder",
    "TrainingFolder",
    "Part",
    "CHECKPOINTS_FOLDER",
    "CHECKPOINT_MANIFEST",
    "DCP_METADATA_FILE",
    "FSDP_MODEL_NAME",
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAMPLER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "CheckpointBusyError",
    "CheckpointDamagedError",
    "CheckpointFileError",
    "NoSpaceError",
    "TensorSpec",
    "background",
    "check_before_loading",
    "check_output_dir",
    "check_sharded",
    "checkpoint_folder",
    "checkpoint_index",
    "custom_checkpoint_file_name",
    "folder_for_load",
    "free_bytes",
    "full_model_file_name",
    "host_copy",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "load_rng_file",
    "load_sharded",
    "load_small_file",
    "local_nbytes",
    "merge_fsdp_weights",
    "model_folder_name",
    "new_folders",
    "no_space_message",
    "optimizer_file_name",
    "optimizer_folder_name",
    "parse_size",
    "plan_shards",
    "prune_checkpoints",
    "read_manifest",
    "read_on_every_rank",
    "remove_new_folders",
    "rng_state_file_name",
    "sampler_file_name",
    "save_file",
    "save_sharded",
    "save_weights",
    "scheduler_file_name",
    "step_in_progress_file_name",
    "verify_checkpoint",
]

__getattr__, __dir__ = lazy_surface(__name__, __file__)

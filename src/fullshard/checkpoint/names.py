"""File and folder names of a training checkpoint, as Accelerate lays it out .

A ``save_state(dir)`` with ``SHARDED_STATE_DICT`` produces::

    dir/
      pytorch_model_fsdp_0/   __0_0.distcp  __1_0.distcp  .metadata   (model_folder_name(0))
      optimizer_0/            __0_0.distcp  __1_0.distcp  .metadata   (optimizer_folder_name(0))
      random_states_0.pkl  random_states_1.pkl                        (rng_state_file_name(rank))
      scheduler.bin  sampler.bin  scaler.pt                           (scheduler_file_name(0), ...)

The constants keep the names Accelerate exports; the helpers build the indexed names so that no caller
formats them by hand. Index 0 has no suffix for the ``.bin`` files (``scheduler.bin``, then
``scheduler_1.bin``), but the sharded folders always carry their index (``optimizer_0``).

The names fullshard adds live here too (the bottom of the package: this module imports nothing): the
manifest and markers that make a folder complete, the staging tag, and the suffixes of the folders a save
leaves beside its target (``dir.incomplete`` while it is written, ``dir.previous`` between the two renames
of its commit; see [Note: whole-checkpoint commit] in ``transaction.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "CHECKPOINT_MANIFEST",
    "FOLDER_MARKER",
    "FSDP_MODEL_NAME",
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "PREVIOUS_SUFFIX",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAMPLER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "STAGING_SUFFIX",
    "STAGING_TAG",
    "STEP_IN_PROGRESS_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "DCP_METADATA_FILE",
    "custom_checkpoint_file_name",
    "dcp_shard_file_name",
    "dcp_shard_prefix",
    "full_model_file_name",
    "is_load_state_part",
    "is_staging_name",
    "model_folder_name",
    "optimizer_file_name",
    "optimizer_folder_name",
    "previous_folder",
    "rng_state_file_name",
    "sampler_file_name",
    "scheduler_file_name",
    "staging_folder",
    "step_in_progress_file_name",
    "weights_shard_file_name",
]

MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
OPTIMIZER_NAME = "optimizer"
RNG_STATE_NAME = "random_states"
SCALER_NAME = "scaler.pt"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
STEP_IN_PROGRESS_NAME = "step_in_progress"  # fullshard's: a world-size-invariant save made mid-step
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
# Accelerate >= 0.30 names the sharded model folder after this prefix (older releases wrote pytorch_model_0).
FSDP_MODEL_NAME = "pytorch_model_fsdp"
# torch.distributed.checkpoint writes this file last, once every rank's data is on disk.
DCP_METADATA_FILE = ".metadata"
# fullshard's own: the manifest of a save_state folder, the marker of one sharded folder (manifest.py), the tag
# naming a staging folder's owner ([Note: one job per checkpoint folder] in transaction.py), the two suffixes.
CHECKPOINT_MANIFEST = ".fullshard_checkpoint.json"
FOLDER_MARKER = ".fullshard_complete.json"
STAGING_TAG = ".fullshard_staging"
STAGING_SUFFIX = ".incomplete"
PREVIOUS_SUFFIX = ".previous"


def _check_index(index: int, arg: str) -> None:
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"{arg}={index!r}: expected a non-negative int. Pass e.g. {arg}=0.")


def model_folder_name(index: int = 0) -> str:
    """Sharded model folder of the ``index``-th prepared model: ``pytorch_model_fsdp_0``."""
    _check_index(index, "index")
    return f"{FSDP_MODEL_NAME}_{index}"


def optimizer_folder_name(index: int = 0) -> str:
    """Sharded optimizer folder of the ``index``-th prepared optimizer: ``optimizer_0``."""
    _check_index(index, "index")
    return f"{OPTIMIZER_NAME}_{index}"


def _indexed_bin(stem: str, index: int) -> str:
    _check_index(index, "index")
    return f"{stem}.bin" if index == 0 else f"{stem}_{index}.bin"


def full_model_file_name(index: int = 0) -> str:
    """Full (unsharded) model state file of ``FULL_STATE_DICT``: ``pytorch_model_fsdp.bin``, then ``..._1.bin``."""
    return _indexed_bin(FSDP_MODEL_NAME, index)


def optimizer_file_name(index: int = 0) -> str:
    """Full (unsharded) optimizer state file: ``optimizer.bin``, then ``optimizer_1.bin``."""
    return _indexed_bin(OPTIMIZER_NAME, index)


def scheduler_file_name(index: int = 0) -> str:
    """Learning-rate scheduler state file: ``scheduler.bin``, then ``scheduler_1.bin``."""
    return _indexed_bin(SCHEDULER_NAME, index)


def sampler_file_name(index: int = 0) -> str:
    """Sampler state file: ``sampler.bin``, then ``sampler_1.bin``."""
    return _indexed_bin(SAMPLER_NAME, index)


def rng_state_file_name(rank: int) -> str:
    """Per-process RNG states: ``random_states_<rank>.pkl`` (one file per rank, no index-0 exception)."""
    _check_index(rank, "rank")
    return f"{RNG_STATE_NAME}_{rank}.pkl"


def step_in_progress_file_name(rank: int) -> str:
    """A rank's partial gradient sums of a world-size-invariant step saved part-way: ``step_in_progress_<rank>.pt``."""
    _check_index(rank, "rank")
    return f"{STEP_IN_PROGRESS_NAME}_{rank}.pt"


def custom_checkpoint_file_name(index: int) -> str:
    """State of the ``index``-th object registered with ``register_for_checkpointing``."""
    _check_index(index, "index")
    return f"custom_checkpoint_{index}.pkl"


def dcp_shard_prefix(rank: int) -> str:
    """What the name of every data file ``rank`` writes with DCP's ``FileSystemWriter`` starts with: ``__<rank>_``."""
    _check_index(rank, "rank")
    return f"__{rank}_"


def dcp_shard_file_name(rank: int) -> str:
    """Data file one rank writes with torch.distributed.checkpoint's ``FileSystemWriter``: ``__<rank>_0.distcp``."""
    return f"{dcp_shard_prefix(rank)}0.distcp"


def staging_folder(target: Path) -> Path:
    """Where a save to ``target`` is written before its commit: ``<target>.incomplete``."""
    return target.with_name(target.name + STAGING_SUFFIX)


def previous_folder(target: Path) -> Path:
    """Where a commit moves the checkpoint it replaces, between its two renames: ``<target>.previous``."""
    return target.with_name(target.name + PREVIOUS_SUFFIX)


def is_staging_name(folder: Path) -> bool:
    """Whether ``folder`` is named as a staging folder (a save that has not committed)."""
    return folder.name.endswith(STAGING_SUFFIX)


_INDEX = r"(_\d+)?"
_LOAD_STATE_PART = re.compile(
    rf"^({FSDP_MODEL_NAME}{_INDEX}(\.bin)?|{OPTIMIZER_NAME}{_INDEX}(\.bin)?|{SCHEDULER_NAME}{_INDEX}\.bin"
    rf"|{SAMPLER_NAME}{_INDEX}\.bin|custom_checkpoint_\d+\.pkl|{RNG_STATE_NAME}_\d+\.pkl"
    rf"|{STEP_IN_PROGRESS_NAME}_\d+\.pt|{re.escape(SCALER_NAME)})$"
)


def is_load_state_part(name: str) -> bool:
    """Whether ``name`` (a file or folder directly in a checkpoint folder) is one that ``load_state`` reads."""
    return _LOAD_STATE_PART.match(name) is not None


def weights_shard_file_name(shard: int, num_shards: int, *, safe_serialization: bool = True) -> str:
    """Name of shard ``shard`` (1-based) of ``num_shards``, as the Hugging Face loaders expect.

    ``model-00001-of-00003.safetensors`` or ``pytorch_model-00001-of-00003.bin``.
    """
    if not 1 <= shard <= num_shards:
        raise ValueError(f"shard={shard}, num_shards={num_shards}: expected 1 <= shard <= num_shards.")
    stem, ext = (SAFE_MODEL_NAME, "safetensors") if safe_serialization else (MODEL_NAME, "bin")
    return f"{stem}-{shard:05d}-of-{num_shards:05d}.{ext}"

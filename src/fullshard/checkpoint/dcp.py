"""Atomic sharded save and load in torch.distributed.checkpoint (DCP) format.

``save_sharded(state, dir)`` / ``load_sharded(state, dir)`` take a state dict whose values are DTensors
(``Shard(0)`` on a 1-D mesh, ``(Replicate(), Shard(0))`` on a 2-D mesh, or any other placement DCP handles),
plain tensors, nested dicts/lists of those, or small Python values (numbers, strings: optimizer
``param_groups``). The folder is a plain DCP folder (``__<rank>_0.distcp`` + ``.metadata``) that torch's own
``dcp.load`` and Accelerate read; it reshards on load (saved with 2 ranks, loaded with 1 or 4).

[Note: atomic save]
A sharded save of one folder is a one-folder transaction: the same protocol as ``save_state`` ([Note:
whole-checkpoint commit] in ``transaction.py``), so the same recovery rules hold.
1. ``begin``: rank 0 claims ``<dir>.incomplete`` (the staging folder) for this job, or every rank raises naming
   the job that writes it ([Note: one job per checkpoint folder]); a ``<dir>.previous`` left by a commit
   killed between its renames is put back.
2. Every rank writes its shards there through ``dcp.save`` (:func:`~fullshard.checkpoint.writer.write_sharded`:
   DCP writes ``.metadata`` last, on rank 0), then checks its own data files against that metadata; all ranks
   agree that every rank succeeded, or every rank raises and the staging folder is removed.
3. ``commit``: rank 0 checks every file's size, writes the completion marker (``.fullshard_complete.json``:
   every file's size and CRC-32, computed while it was written, see ``checksum.py``, and the ``save_id``),
   moves an existing ``<dir>`` aside to ``<dir>.previous``, renames the staging folder to ``<dir>`` and deletes
   the previous one; all ranks agree the commit happened.
A failure on any rank at any step makes every rank raise (each "agree" is an all-gather, so no rank waits
forever on a peer that raised) and leaves ``<dir>`` as it was. A rank that dies outright makes its peers time
out in the next collective, with the same result. A staging folder left by a killed save has no marker and its
name ends in ``.incomplete``: ``load_sharded`` and ``merge_fsdp_weights`` refuse it as incomplete, and the next
save removes it once its owner is gone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fullshard.checkpoint.agreement import gather_errors
from fullshard.checkpoint.folder import check_output_dir
from fullshard.checkpoint.reader import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_checked,
    read_checked_metadata,
    resolve_checkpoint_dir,
)
from fullshard.checkpoint.transaction import SaveTransaction
from fullshard.checkpoint.writer import check_state, local_nbytes

__all__ = ["check_sharded", "load_sharded", "save_sharded"]

_State = dict[str, Any]
_Folder = str | os.PathLike[str]
_Group = dist.ProcessGroup | None


def save_sharded(state: _State, checkpoint_dir: _Folder, *, process_group: _Group = None) -> Path:
    """Save ``state`` (every rank its own shards) to ``checkpoint_dir`` atomically; returns the folder.

    A collective over ``process_group`` (default: the world; no process group: a single-process save).
    Postcondition on success: ``checkpoint_dir`` holds the new, complete checkpoint. On failure (any rank):
    every rank raises and ``checkpoint_dir`` still holds whatever it held before. See [Note: atomic save].
    """
    check_state(state, "save_sharded")
    shown = f"'{checkpoint_dir}'" if isinstance(checkpoint_dir, str | os.PathLike) else repr(checkpoint_dir)
    where = f"save_sharded(checkpoint_dir={shown})"
    tx = SaveTransaction(check_output_dir(checkpoint_dir, where), where, process_group, sharded_folder=True)
    tx.begin()

    tx.step("writing shards", lambda: tx.write_sharded("", state), local_nbytes(state))
    return tx.commit()


def check_sharded(state: _State, checkpoint_dir: _Folder, *, process_group: _Group = None, strict: bool = True) -> None:
    """Raise, on every rank, if :func:`load_sharded` of ``checkpoint_dir`` into ``state`` would be refused.

    A collective over ``process_group``; reads only ``.metadata`` and file sizes, modifies nothing. Checks
    that the folder is complete (every data file present and long enough), that every key of ``state`` is
    in it with the same global shape, and (``strict``) that it holds no key ``state`` lacks. Call it on
    every folder of a multi-folder checkpoint (model, optimizer) before loading any of them.
    """
    _checked_metadata(state, checkpoint_dir, process_group, strict)


def _checked_metadata(state: _State, checkpoint_dir: _Folder, pg: _Group, strict: bool) -> tuple[Path, Metadata]:
    error: BaseException | None = None
    try:
        check_state(state, "load_sharded")
        root = resolve_checkpoint_dir(checkpoint_dir, caller="load_sharded")
        metadata = read_checked_metadata(root)
        _check_keys_and_shapes(state, metadata, root, strict)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        error = exc
    bad = sorted(gather_errors(error, pg))
    if error is not None:
        raise error  # the same checks fail alike on every rank, so each raises its own precise error
    if bad:
        raise RuntimeError(
            f"load_sharded(checkpoint_dir='{checkpoint_dir}'): the checks failed on rank(s) {bad} (see their errors) "
            "but passed here; every rank must pass the same state dict keys and the same folder."
        )
    return root, metadata


_PARTLY_LOADED = (
    " The state's tensors read before the damaged one already hold the checkpoint's values: load a good "
    "checkpoint before training on."
)


def load_sharded(state: _State, checkpoint_dir: _Folder, *, process_group: _Group = None, strict: bool = True) -> None:
    """Load ``checkpoint_dir`` into ``state`` in place (tensors and DTensors are filled; other values replaced).

    The checkpoint may have been saved with any number of ranks and any sharding. Before any collective,
    every rank checks that the folder is complete, that every key of ``state`` is in it with the same
    shape, and (``strict``) that it holds no key ``state`` lacks; any failure raises on every rank, naming the
    keys and shapes (:func:`check_sharded`), and leaves ``state`` untouched. Pass ``strict=False`` to load a
    subset of a checkpoint.
    """
    root, metadata = _checked_metadata(state, checkpoint_dir, process_group, strict)
    reader = SafeFileSystemReader(root, metadata)
    load_checked(state, reader, process_group=process_group, note=_PARTLY_LOADED)  # one line on every rank


def _flat(state: dict[str, Any], metadata: Metadata) -> dict[str, Any]:
    # DCP's own planner flattens nested dicts/lists into the dotted keys it stores; reuse it so keys match.
    planner = SafeLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return planner.state_dict


def _listed(items: list[str], limit: int = 20) -> str:
    return f"{items[:limit]} and {len(items) - limit} more" if len(items) > limit else str(items)


def _check_keys_and_shapes(state: dict[str, Any], metadata: Metadata, root: Path, strict: bool) -> None:
    flat = _flat(state, metadata)
    stored = metadata.state_dict_metadata
    missing = sorted(k for k in flat if k not in stored)
    unexpected = sorted(k for k in stored if k not in flat) if strict else []
    mismatched = []
    for key, value in flat.items():
        md = stored.get(key)
        if isinstance(value, torch.Tensor) and md is not None:
            saved = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "a non-tensor value"
            if saved != tuple(value.shape):
                mismatched.append(f"{key}: checkpoint {saved}, target {tuple(value.shape)}")
    if missing or unexpected or mismatched:
        raise ValueError(
            f"load_sharded(checkpoint_dir='{root}'): the checkpoint does not match the target state dict. "
            f"Missing from the checkpoint: {_listed(missing)}. In the checkpoint but not the target: "
            f"{_listed(unexpected)}. Shape mismatches: {_listed(mismatched)}. Load into the state dict of the "
            "model that was saved" + (", or pass strict=False to ignore extra checkpoint keys." if unexpected else ".")
        )

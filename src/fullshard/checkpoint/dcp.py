"""Atomic sharded save and load in torch.distributed.checkpoint (DCP) format.

``save_sharded(state, dir)`` / ``load_sharded(state, dir)`` take a state dict whose values are DTensors
(``Shard(0)`` on a 1-D mesh, ``(Replicate(), Shard(0))`` on a 2-D mesh, or any other placement DCP handles),
plain tensors, nested dicts/lists of those, or small Python values (numbers, strings: optimizer
``param_groups``). The folder is a plain DCP folder (``__<rank>_0.distcp`` + ``.metadata``) that torch's own
``dcp.load`` and Accelerate read; it reshards on load (saved with 2 ranks, loaded with 1 or 4).

[Note: atomic save]
1. Rank 0 claims ``<dir>.incomplete`` (the staging folder) for this job, or raises naming the job that
   writes it ([Note: one job per checkpoint folder] in ``transaction.py``); all ranks agree it is ready.
2. Every rank writes its shards there through ``dcp.save`` (DCP writes ``.metadata`` last, on rank 0), then
   checks its own data files against that metadata; all ranks agree that every rank succeeded.
3. Rank 0 writes the completion marker (``.fullshard_complete.json``: every file's size and CRC-32, computed
   while it was written, see ``checksum.py``, and a ``save_id``), moves
   an existing ``<dir>`` aside to ``<dir>.previous``, renames the staging folder to ``<dir>`` and deletes the
   previous one; all ranks agree the commit happened.
A failure on any rank at any step makes every rank raise (each "agree" is an all-gather of success flags, so
no rank waits forever on a peer that raised) and leaves ``<dir>`` as it was. A rank that dies outright makes
its peers time out in the next collective, with the same result. The staging folder has no marker and its
name ends in ``.incomplete``: ``load_sharded`` and ``merge_fsdp_weights`` refuse it as incomplete.

``Accelerator.save_state`` does not use this per-folder commit: it writes every part of a checkpoint with
:func:`write_sharded` into one staging folder that is committed whole (``transaction.py``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from fullshard.checkpoint.checksum import ChecksummingFileSystemWriter
from fullshard.checkpoint.collective import describe_error
from fullshard.checkpoint.manifest import MANIFEST_FORMAT, MANIFEST_VERSION, FileRecord, write_json_durably
from fullshard.checkpoint.reader import (
    COMPLETE_MARKER,
    INCOMPLETE_SUFFIX,
    PREVIOUS_SUFFIX,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_data_files,
    damaged_item,
    quiet_single_process_warning,
    read_metadata,
    resolve_checkpoint_dir,
)
from fullshard.checkpoint.transaction import STAGING_TAG, claim_staging, fsync_dir, release_staging
from fullshard.ranks import gather_from_ranks, rank_and_world

__all__ = ["check_sharded", "load_sharded", "save_sharded", "write_sharded"]

_LEAF_TYPES = (torch.Tensor, int, float, bool, str, bytes, type(None))


def _check_value(value: Any, where: str, caller: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise ValueError(
                    f"{caller}: key {key!r} in {where or 'state'} is a {type(key).__name__}; use str keys."
                )
            _check_value(item, f"{where}.{key}" if where else str(key), caller)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_value(item, f"{where}.{i}", caller)
    elif not isinstance(value, _LEAF_TYPES):
        raise ValueError(
            f"{caller}: state[{where!r}] is a {type(value).__name__}; expected tensors (or DTensors), nested "
            "dicts/lists of them, or numbers/strings. Pass module.state_dict(), not the module."
        )


def _check_state(state: object, caller: str) -> None:
    if not isinstance(state, dict) or not state:
        got = type(state).__name__ if not isinstance(state, dict) else "an empty dict"
        raise ValueError(
            f"{caller}(state={got}): expected a non-empty dict, e.g. {caller}({{'model': model.state_dict()}}, dir)."
        )
    _check_value(state, "", caller)


def _check_dir_arg(checkpoint_dir: object, caller: str) -> Path:
    if not isinstance(checkpoint_dir, str | os.PathLike):
        raise ValueError(f"{caller}(checkpoint_dir={checkpoint_dir!r}): expected a folder path (str or Path).")
    path = Path(checkpoint_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{caller}(checkpoint_dir='{path}'): a file is in the way; pass a folder path.")
    if path.name.endswith((INCOMPLETE_SUFFIX, PREVIOUS_SUFFIX)):
        raise ValueError(
            f"{caller}(checkpoint_dir='{path}'): names ending in {INCOMPLETE_SUFFIX!r} or "
            f"{PREVIOUS_SUFFIX!r} are reserved for staging; pick another name."
        )
    return path


def _failed_ranks(error: BaseException | None, process_group: dist.ProcessGroup | None) -> list[int]:
    """Ranks whose ``error`` is set (a collective when there is more than one rank: every rank must call it)."""
    _, world = rank_and_world(process_group)
    if world == 1:
        return [0] if error is not None else []
    # An all-gather of flags rather than a barrier: a rank that failed still answers, so no peer waits forever.
    flags = [torch.zeros(1, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(flags, torch.tensor([int(error is not None)], dtype=torch.int32), group=process_group)
    return [r for r, f in enumerate(flags) if f.item()]


def _agree(error: BaseException | None, process_group: dist.ProcessGroup | None, what: str, hint: str = "") -> None:
    """Raise on every rank if ``error`` is set on any rank (a collective: every rank must call it)."""
    bad = _failed_ranks(error, process_group)
    if bad:
        rank = rank_and_world(process_group)[0]
        local = f" This rank ({rank}) failed: {describe_error(error)}" if error is not None else ""
        raise RuntimeError(f"{what} failed on rank(s) {bad}.{hint}{local}") from error


def save_sharded(
    state: dict[str, Any], checkpoint_dir: str | os.PathLike[str], *, process_group: dist.ProcessGroup | None = None
) -> Path:
    """Save ``state`` (every rank its own shards) to ``checkpoint_dir`` atomically; returns the folder.

    A collective over ``process_group`` (default: the world; no process group: a single-process save).
    Postcondition on success: ``checkpoint_dir`` holds the new, complete checkpoint. On failure (any rank):
    every rank raises and ``checkpoint_dir`` still holds whatever it held before. See [Note: atomic save].
    """
    _check_state(state, "save_sharded")
    path = _check_dir_arg(checkpoint_dir, "save_sharded")
    rank, world = rank_and_world(process_group)
    staging = path.with_name(path.name + INCOMPLETE_SUFFIX)
    where = f"save_sharded(checkpoint_dir='{path}')"
    keep = f" The checkpoint at '{path}' is unchanged; the partial save is in '{staging}'."
    pg = process_group
    save_id = _run_step(lambda: claim_staging(path) if rank == 0 else "", pg, f"{where}: claiming the staging folder")
    try:
        write = lambda: write_sharded(state, staging, process_group=pg)  # noqa: E731
        records = _run_step(write, pg, f"{where}: writing shards", keep)
        everyone = gather_from_ranks(records, pg)
        files = {name: record for ranks_files in everyone for name, record in ranks_files.items()}
        _run_step(lambda: _commit(staging, path, world, files) if rank == 0 else None, pg, f"{where}: committing", keep)
    finally:
        release_staging(save_id)
    return path


def _run_step(step: Any, process_group: dist.ProcessGroup | None, what: str, hint: str = "") -> Any:
    error: BaseException | None = None
    result = None
    try:
        result = step()
    except (Exception, dcp.CheckpointException) as exc:  # CheckpointException is a BaseException
        error = exc
    _agree(error, process_group, what, hint)
    return result


def write_sharded(
    state: dict[str, Any], folder: str | os.PathLike[str], *, process_group: dist.ProcessGroup | None = None
) -> dict[str, FileRecord]:
    """Write ``state`` with DCP into ``folder`` (no staging, no marker); returns this rank's files' records.

    A collective. The records (size and CRC-32 of each file, ``.metadata`` on the coordinator) are computed
    while the files are written. DCP raises on every rank if any rank failed to write.
    """
    _check_state(state, "write_sharded")
    rank, _ = rank_and_world(process_group)
    writer = ChecksummingFileSystemWriter(folder)
    with quiet_single_process_warning():
        dcp.save(_without_views(state), storage_writer=writer, process_group=process_group)
    _verify_own_files(Path(folder), rank)
    return writer.records


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory under a tensor whose storage is exactly that memory (no copy), if it is a view.

    [Note: saving views]
    fullshard's sharded parameters are views of a unit's flat shard. ``torch.save`` writes a view's whole
    storage, so DCP's writer clones every tensor whose storage is larger than the tensor before writing it:
    a copy (page faults, zero-fill, memcpy) of every parameter during each save. A contiguous CPU view is
    instead aliased by a tensor built over the same bytes (``torch.frombuffer``), whose storage is exactly its
    bytes; DCP then writes it as it is. The alias lives only during the save.
    """
    if (
        tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or tensor.untyped_storage().nbytes() == tensor.nbytes
        or tensor.numel() == 0
    ):
        return tensor
    raw = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    return torch.frombuffer(raw, dtype=torch.uint8).view(tensor.dtype).view(tensor.shape)


def _without_views(value: Any) -> Any:
    """``value`` with every view tensor (or DTensor's local view) aliased by :func:`_own_storage`."""
    if isinstance(value, dict):
        return {key: _without_views(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_without_views(item) for item in value)
    if isinstance(value, DTensor):
        local = value.to_local()
        alias = _own_storage(local)
        if alias is local:
            return value
        return DTensor.from_local(
            alias, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    if isinstance(value, torch.Tensor):
        return _own_storage(value)
    return value


def _verify_own_files(staging: Path, rank: int) -> None:
    """This rank's data files are on disk and as long as the metadata says (DCP wrote .metadata on rank 0)."""
    metadata = read_metadata(staging)
    own = f"__{rank}_"
    for info in (metadata.storage_data or {}).values():
        if info.relative_path.startswith(own):
            file = staging / info.relative_path
            if not file.is_file() or file.stat().st_size < info.offset + info.length:
                raise RuntimeError(f"{file} is missing or shorter than its metadata says after writing it.")


def _commit(staging: Path, path: Path, world: int, files: dict[str, FileRecord]) -> None:
    """Rank 0 only: mark the staging folder complete and rename it into place. See [Note: atomic save]."""
    check_data_files(staging, read_metadata(staging))
    for name, record in sorted(files.items()):
        size = (staging / name).stat().st_size if (staging / name).is_file() else None
        if size != record.size:
            raise RuntimeError(f"{staging / name} is {size} bytes on disk after writing {record.size}.")
    marker = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "save_id": uuid.uuid4().hex,
        "world_size": world,
        "files": {name: record.to_json() for name, record in sorted(files.items())},
    }
    write_json_durably(staging / COMPLETE_MARKER, marker)
    previous = path.with_name(path.name + PREVIOUS_SUFFIX)
    if path.exists():
        if previous.exists():
            shutil.rmtree(previous)
        os.replace(path, previous)
    os.replace(staging, path)
    (path / STAGING_TAG).unlink(missing_ok=True)
    shutil.rmtree(previous, ignore_errors=True)
    fsync_dir(path.parent)


def check_sharded(
    state: dict[str, Any],
    checkpoint_dir: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
) -> None:
    """Raise, on every rank, if :func:`load_sharded` of ``checkpoint_dir`` into ``state`` would be refused.

    A collective over ``process_group``; reads only ``.metadata`` and file sizes, modifies nothing. Checks
    that the folder is complete (every data file present and long enough), that every key of ``state`` is
    in it with the same global shape, and (``strict``) that it holds no key ``state`` lacks. Call it on
    every folder of a multi-folder checkpoint (model, optimizer) before loading any of them.
    """
    _checked_metadata(state, checkpoint_dir, process_group, strict)


def _checked_metadata(
    state: dict[str, Any],
    checkpoint_dir: str | os.PathLike[str],
    process_group: dist.ProcessGroup | None,
    strict: bool,
) -> tuple[Path, Metadata]:
    error: BaseException | None = None
    try:
        _check_state(state, "load_sharded")
        root = resolve_checkpoint_dir(checkpoint_dir, caller="load_sharded")
        metadata = read_metadata(root)
        check_data_files(root, metadata)
        _check_keys_and_shapes(state, metadata, root, strict)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        error = exc
    bad = _failed_ranks(error, process_group)
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


def load_sharded(
    state: dict[str, Any],
    checkpoint_dir: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
) -> None:
    """Load ``checkpoint_dir`` into ``state`` in place (tensors and DTensors are filled; other values replaced).

    The checkpoint may have been saved with any number of ranks and any sharding. Before any collective,
    every rank checks that the folder is complete, that every key of ``state`` is in it with the same
    shape, and (``strict``) that it holds no key ``state`` lacks; any failure raises on every rank, naming the
    keys and shapes (:func:`check_sharded`), and leaves ``state`` untouched. Pass ``strict=False`` to load a
    subset of a checkpoint.
    """
    root, metadata = _checked_metadata(state, checkpoint_dir, process_group, strict)
    try:
        with quiet_single_process_warning():
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(root, metadata),
                planner=SafeLoadPlanner(),
                process_group=process_group,
            )
    except dcp.CheckpointException as exc:  # a damaged item (see [Note: checked reads]): one line on every rank
        damaged = damaged_item(exc, note=_PARTLY_LOADED)
        if damaged is None:
            raise
        raise damaged from None


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

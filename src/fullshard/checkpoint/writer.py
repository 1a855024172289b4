"""Write one sharded (DCP) folder: every rank its own shards, each file checksummed as it is written.

:func:`write_sharded` writes no staging folder, marker or manifest: it is one step of a save, and
``transaction.py`` commits what it wrote (``save_state``'s parts, or ``save_sharded``'s one folder).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from fullshard.checkpoint.checksum import ChecksummingFileSystemWriter
from fullshard.checkpoint.files import write_replacing
from fullshard.checkpoint.manifest import FileRecord
from fullshard.checkpoint.names import dcp_shard_prefix
from fullshard.checkpoint.reader import check_data_lengths, quiet_single_process_warning, read_metadata
from fullshard.ranks import rank_and_world

__all__ = ["check_state", "local_nbytes", "save_file", "write_sharded"]

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


def check_state(state: object, caller: str) -> None:
    if not isinstance(state, dict) or not state:
        got = type(state).__name__ if not isinstance(state, dict) else "an empty dict"
        raise ValueError(
            f"{caller}(state={got}): expected a non-empty dict, e.g. {caller}({{'model': model.state_dict()}}, dir)."
        )
    _check_value(state, "", caller)


def local_nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` held by this rank (a DTensor's local shard): what a save writes of it."""
    if isinstance(value, dict):
        return sum(local_nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(local_nbytes(v) for v in value)
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.numel() * local.element_size()
    return 0


def write_sharded(
    state: dict[str, Any], folder: str | os.PathLike[str], *, process_group: dist.ProcessGroup | None = None
) -> dict[str, FileRecord]:
    """Write ``state`` with DCP into ``folder`` (no staging, no marker); returns this rank's files' records.

    A collective. The records (size and CRC-32 of each file, ``.metadata`` on the coordinator) are computed
    while the files are written. DCP raises on every rank if any rank failed to write.
    """
    check_state(state, "write_sharded")
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
    check_data_lengths(staging, read_metadata(staging), prefix=dcp_shard_prefix(rank))


def save_file(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj)`` to ``path`` whole or not at all: a new file under a name unique to this write, fsync'd
    and renamed over ``path`` (see [Note: exclusive creation] in ``files.py``). For a file outside a checkpoint
    folder's transaction (``save_fsdp_model``'s full state dict)."""
    write_replacing(Path(path), lambda f: torch.save(obj, f))

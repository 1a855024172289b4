"""Read torch.distributed.checkpoint (DCP) folders safely, and decide whether one is complete.

A DCP folder holds ``__<rank>_0.distcp`` data files and a ``.metadata`` file that DCP writes last, once
every rank's data is on disk. Folders written by :func:`fullshard.checkpoint.dcp.save_sharded` also hold a
completion marker (``names.FOLDER_MARKER``, with the data files' sizes) and are renamed into place only
when whole; while being written they are named ``<name>.incomplete`` (``names.STAGING_SUFFIX``). What a
folder is (staging, incomplete, complete) is decided in ``folder.py``; this module reads what it may load.

[Note: no arbitrary unpickling]
torch's ``FileSystemReader.read_metadata`` runs ``pickle.load`` on ``.metadata`` and its default load
planner runs ``torch.load(weights_only=False)`` on non-tensor entries: a crafted checkpoint could run code.
Here ``.metadata`` goes through :class:`_MetadataUnpickler`, which only builds DCP's metadata dataclasses,
``torch.Size``, dtypes/layouts/memory formats and paths, and non-tensor entries load with
``weights_only=True`` (:class:`SafeLoadPlanner`). Tensor data itself is read by torch with
``weights_only=True`` already.

[Note: checked reads]
A flipped bit inside a data file of the right size would otherwise load as a wrong weight, silently. The
completion marker of a folder saved by fullshard records the CRC-32 of every stored item (``manifest.py``),
and :class:`SafeFileSystemReader` checks each item it reads against it, as it reads: the bytes read straight
into a tensor are checksummed from memory (ISA-L: about 9 GB/s per core), the rest of the item is read again
and the CRCs combined (its ``torch.save`` framing, a few hundred bytes; for a resharded load that takes only
some rows of the item, its other rows too: the price of never loading an unchecked byte), and other items are
read whole and checked before torch parses them. A mismatch raises :class:`CheckpointDamagedError` naming the
file, the entry and both CRCs; DCP raises it on every rank. Tensors read before the damaged item already hold
their new values, so the message says to load a good checkpoint before training on. Not checked: folders
whose marker lists no items (saved by Accelerate, by torch, or by fullshard before 2026-11-24, or without the
``isal`` package); ``verify`` (``fullshard verify``, ``load_state(verify=True)``) checks whole files, every
byte, in every case.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from fullshard.checkpoint.boundary import entry_path
from fullshard.checkpoint.checksum import crc32, crc32_combine
from fullshard.checkpoint.direct_read import (
    ItemView,
    advise_sequential,
    locate,
    read_exactly,
    read_item_into,
)
from fullshard.checkpoint.errors import CheckpointDamagedError
from fullshard.checkpoint.folder import check_enclosing, check_sizes, missing_hint, missing_message, staging_error
from fullshard.checkpoint.manifest import read_folder_marker
from fullshard.checkpoint.names import (
    DCP_METADATA_FILE,
    FOLDER_MARKER,
    FSDP_MODEL_NAME,
    PREVIOUS_SUFFIX,
    STAGING_SUFFIX,
    dcp_shard_file_name,
    is_staging_name,
)

__all__ = [
    "check_data_lengths",
    "COMPLETE_MARKER",
    "INCOMPLETE_SUFFIX",
    "PREVIOUS_SUFFIX",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "check_data_files",
    "damaged_item",
    "load_checked",
    "read_checked_metadata",
    "quiet_single_process_warning",
    "read_error_line",
    "read_every_item",
    "read_metadata",
    "resolve_checkpoint_dir",
    "storage_files",
]

COMPLETE_MARKER = FOLDER_MARKER  # the names of names.py, as this module exported them before it
INCOMPLETE_SUFFIX = STAGING_SUFFIX

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
}


_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` and nothing else. See [Note: no arbitrary unpickling]."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_ENUMS):
            return getattr(torch, name)
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed in a checkpoint's .metadata (only DCP metadata types are)."
        )


@contextmanager
def quiet_single_process_warning() -> Iterator[None]:
    """Silence DCP's per-call warning that it runs without a process group, when that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def read_metadata(checkpoint_dir: str | os.PathLike[str]) -> Metadata:
    """Load ``checkpoint_dir/.metadata`` without running arbitrary code, checked against the CRC-32 the folder's
    completion marker recorded for it (if it has one: see [Note: checked reads]); errors name the file."""
    path = entry_path(checkpoint_dir, DCP_METADATA_FILE)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist: the checkpoint is incomplete or not a DCP folder.") from None
    marker = read_folder_marker(checkpoint_dir)
    saved = marker.files.get(DCP_METADATA_FILE) if marker is not None else None
    actual = crc32(data) if saved is not None and saved.crc32 is not None else None
    if actual is not None and actual != saved.crc32:
        raise CheckpointDamagedError(
            f"{path} is corrupt: its CRC-32 is {actual:#010x}, but it was saved with {saved.crc32:#010x}. "
            "Load another checkpoint."
        )
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise RuntimeError(f"{path} is corrupt or not DCP metadata ({type(exc).__name__}: {exc}).") from exc
    if not isinstance(metadata, Metadata):
        raise RuntimeError(f"{path} holds a {type(metadata).__name__}, not torch.distributed.checkpoint Metadata.")
    storage_files(checkpoint_dir, metadata)
    _check_chunks(path, metadata)
    return metadata


def _check_chunks(path: Path, metadata: Metadata) -> None:
    """Every stored tensor's chunks lie inside its shape, cover it exactly once and each have a storage entry:
    otherwise a merge (which takes the shape from here) or a load would keep bytes no item supplied."""
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            why = _tiling_problem(fqn, md, metadata.storage_data)
            if why:
                raise CheckpointDamagedError(f"{path} is damaged: {fqn!r} {why}. Load another checkpoint.")


def _tiling_problem(fqn: str, md: TensorStorageMetadata, storage: dict[MetadataIndex, Any]) -> str:
    size = tuple(md.size)
    boxes = []
    for chunk in md.chunks:
        offsets, lengths = tuple(chunk.offsets), tuple(chunk.sizes)
        if not all(type(v) is int for v in (*size, *offsets, *lengths)) or not len(offsets) == len(lengths) == len(
            size
        ):
            return f"has a chunk at {list(offsets)} of {list(lengths)} that does not fit its shape {list(size)}"
        if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, size, strict=True)):
            return f"has a chunk at {list(offsets)} of {list(lengths)} outside its shape {list(size)}"
        if MetadataIndex(fqn, torch.Size(offsets)) not in storage:
            return f"has a chunk at {list(offsets)} with no stored item"
        boxes.append((offsets, lengths))
    if sum(math.prod(n) for _, n in boxes) != math.prod(size) or any(
        all(a < c + m and c < a + n for a, n, c, m in zip(*boxes[i], *boxes[j], strict=True))
        for i in range(len(boxes))
        for j in range(i)
        if math.prod(boxes[i][1]) and math.prod(boxes[j][1])
    ):
        return f"has chunks that do not cover its shape {list(size)} exactly once"
    return ""


def storage_files(checkpoint_dir: str | os.PathLike[str], metadata: Metadata) -> dict[str, Path]:
    """The data files ``metadata``'s storage entries point into, by relative path, each resolved inside
    ``checkpoint_dir`` (see [Note: a checkpoint folder is a boundary] in ``boundary.py``); an entry whose path
    leads outside, or whose offset or length is not a byte count, raises :class:`CheckpointDamagedError`
    naming it, before any data file is opened."""
    root = Path(checkpoint_dir)
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointDamagedError(
            f"{root / DCP_METADATA_FILE} is damaged: it lists no stored items. Load another checkpoint."
        )
    files: dict[str, Path] = {}
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        if rel not in files:
            files[rel] = entry_path(root, rel, listed_in=DCP_METADATA_FILE)
        span = (getattr(info, "offset", None), getattr(info, "length", None))
        if not all(type(v) is int and v >= 0 for v in span):
            raise CheckpointDamagedError(
                f"{root / DCP_METADATA_FILE} is damaged: the entry of {getattr(index, 'fqn', index)!r} in {rel!r} has "
                f"offset {span[0]!r} and length {span[1]!r}, which are not byte counts. Load another checkpoint."
            )
    return files


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that reads ``.metadata`` once, through the restricted unpickler, and caches it, reads
    tensor items straight into their targets where it can (see [Note: direct tensor reads]), and checks every
    item it reads, whole or in part, against the CRC-32 recorded when it was saved (see [Note: checked reads])."""

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata
        self._checksums: dict[tuple[str, int, int], int] | None = None
        self._files: dict[str, Path] = {}
        self._chunk_sizes: dict[MetadataIndex, tuple[int, ...]] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = read_metadata(self.path)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._files = storage_files(self.path, metadata)  # before torch's reader can open any of them
        self._chunk_sizes = {
            MetadataIndex(fqn, chunk.offsets): tuple(chunk.sizes)
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
            for chunk in md.chunks
        }
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def _expected_crc(self, relative_path: str, offset: int, length: int) -> int | None:
        if self._checksums is None:
            marker = read_folder_marker(self.path) if crc32_combine is not None else None  # ISA-L combines CRCs
            records = marker.files.items() if marker is not None else ()  # none: checked reads are off
            self._checksums = {(name, o, n): crc for name, record in records for o, n, crc in record.items}
        expected = self._checksums.get((relative_path, offset, length))
        if expected is None and self._checksums:  # check_data_files refuses this first; never read it unchecked
            raise _unlisted_item(Path(self.path), relative_path, offset, length)
        return expected

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for request in plan.items:
            per_file.setdefault(self.storage_data[request.storage_index].relative_path, []).append(request)
        rest: list[ReadItem] = []
        for relative_path, requests in per_file.items():
            with open(self._files[relative_path], "rb", buffering=0) as file:
                advise_sequential(file)
                requests.sort(key=lambda r: self.storage_data[r.storage_index].offset)  # one pass, front to back
                for request in requests:
                    try:
                        direct = self._read_direct(file, request, planner)
                    except CheckpointDamagedError:
                        raise
                    except Exception as exc:  # unreadable framing, say: name the damage if the checksum sees it
                        self._check_whole_item(file, request)
                        if isinstance(exc, _NOT_DAMAGE):
                            raise
                        raise self._unreadable(exc, [request]) from exc
                    if not direct:
                        self._check_whole_item(file, request)
                        rest.append(request)
        if rest:  # non-tensor entries and layouts the direct path does not take: torch's own reader
            try:
                return super().read_data(dataclasses.replace(plan, items=rest), planner)
            except _NOT_DAMAGE:
                raise
            except Exception as exc:  # the items' bytes were checked (if recorded): they do not fit .metadata
                raise self._unreadable(exc, rest) from exc
        done: Future[None] = Future()  # torch's future: DCP calls .wait() on it
        done.set_result(None)
        return done

    def _read_direct(self, file: io.RawIOBase, request: ReadItem, planner: LoadPlanner) -> bool:
        info = self.storage_data[request.storage_index]
        if request.type != LoadItemType.TENSOR or info.transform_descriptors:
            return False
        stored = locate(ItemView(file, info.offset, info.length))
        if stored is None:
            return False
        chunk = self._chunk_sizes.get(request.storage_index)
        if chunk is not None and stored.shape != chunk:  # another item's bytes: never narrow them into place
            self._check_whole_item(file, request)  # a flipped byte is called that, if the checksum sees it
            raise CheckpointDamagedError(
                f"{self._files[info.relative_path]} is damaged: the item .metadata gives for "
                f"{request.storage_index.fqn!r} holds a tensor of shape {list(stored.shape)}, not {list(chunk)}. "
                "Load another checkpoint."
            )
        target = planner.resolve_tensor(request).detach()
        expected = self._expected_crc(info.relative_path, info.offset, info.length)
        span = [info.offset + stored.offset, 0, 0]  # the bytes read: where they start in the file, how many, CRC

        def seen(position: int, view: memoryview) -> None:
            span[:] = [position, len(view), crc32(view)]

        if not read_item_into(
            file,
            info.offset,
            stored,
            tuple(request.storage_offsets),
            tuple(request.lengths),
            target,
            seen=seen if expected is not None else None,
        ):
            return False
        if expected is not None:
            self._check(request, expected, _item_crc(file, info.offset, info.length, *span))
        planner.commit_tensor(request, target)
        return True

    def _unreadable(self, exc: Exception, requests: list[ReadItem]) -> CheckpointDamagedError:
        """A read of ``requests`` failed in a way no checksum explained: their bytes do not fit ``.metadata``."""
        files = sorted({str(self._files[self.storage_data[r.storage_index].relative_path]) for r in requests})
        fqns = sorted({r.storage_index.fqn for r in requests})
        first = (str(exc).strip().splitlines() or [""])[0].split(". ")[0]  # never torch's weights_only advice
        return CheckpointDamagedError(
            f"{', '.join(files)} is damaged: the stored bytes of {', '.join(map(repr, fqns[:3]))} cannot be read as "
            f"{DCP_METADATA_FILE} describes them ({type(exc).__name__}: {first}). Load another checkpoint "
            "(`fullshard verify FOLDER` names every damaged file)."
        )

    def _check_whole_item(self, file: io.RawIOBase, request: ReadItem) -> None:
        """Read a stored item whole and check it, before torch's reader parses it."""
        info = self.storage_data[request.storage_index]
        expected = self._expected_crc(info.relative_path, info.offset, info.length)
        if expected is not None:
            self._check(request, expected, _crc_of(file, info.offset, info.length))

    def _check(self, request: ReadItem, expected: int, actual: int) -> None:
        if actual == expected:
            return
        info = self.storage_data[request.storage_index]
        raise CheckpointDamagedError(
            f"{Path(self.path) / info.relative_path} is corrupt: the bytes of {request.storage_index.fqn!r} (offset "
            f"{info.offset}, {info.length} bytes) have CRC-32 {actual:#010x}, but were saved with {expected:#010x}. "
            "Load another checkpoint (`fullshard verify FOLDER` names every damaged file)."
        )


def damaged_item(exc: BaseException, *, note: str = "") -> CheckpointDamagedError | None:
    """The :class:`CheckpointDamagedError` a checked read raised on some rank, out of DCP's wrapper (every rank
    gets every rank's failures), with ``note`` appended; ``None`` if the failure was another."""
    failures = getattr(exc, "failures", None) or {}
    causes = [failure[0] for _, failure in sorted(failures.items()) if isinstance(failure, tuple)]
    cause = next((c for c in [*causes, exc] if isinstance(c, CheckpointDamagedError)), None)
    return None if cause is None else CheckpointDamagedError(f"{cause}{note}")


def load_checked(
    state: dict[str, Any],
    reader: SafeFileSystemReader,
    *,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    note: str = "",
) -> None:
    """``dcp.load`` of ``state`` through ``reader`` and :class:`SafeLoadPlanner`; a damaged item raises one
    :class:`CheckpointDamagedError` (with ``note`` appended), out of DCP's wrapper, on every rank."""
    try:
        with quiet_single_process_warning():
            dcp.load(
                state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=process_group, no_dist=no_dist
            )
    except dcp.CheckpointException as exc:  # see [Note: checked reads]
        damaged = damaged_item(exc, note=note)
        if damaged is None:
            raise
        raise damaged from None


def _item_crc(file: io.RawIOBase, offset: int, length: int, start: int, size: int, read_crc: int) -> int:
    """The CRC-32 of the item at ``offset`` (``length`` bytes) of which bytes ``start : start + size`` were
    checksummed as they were read (``read_crc``): the rest of the item is read again and the CRCs combined.

    For a whole tensor the rest is its ``torch.save`` framing (a few hundred bytes); for a resharded load that
    takes only some rows of a stored chunk it is the other rows as well, read in bounded pieces."""
    before = _crc_of(file, offset, start - offset)
    end = start + size
    after = _crc_of(file, end, offset + length - end)
    return crc32_combine(crc32_combine(before, read_crc, size), after, offset + length - end)


_NOT_DAMAGE = (CheckpointDamagedError, OSError, MemoryError)  # raised as they are by read_data
_PIECE = 8 << 20  # bytes read at a time when checksumming the parts of an item not read into a tensor


def _crc_of(file: io.RawIOBase, start: int, size: int) -> int:
    value = 0
    piece = bytearray(min(size, _PIECE))
    for position in range(start, start + size, _PIECE):
        view = memoryview(piece)[: min(_PIECE, start + size - position)]
        read_exactly(file, position, view)
        value = crc32(view, value)
    return value


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor entries load with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        # mappings[fqn] is the path of keys / list indices from the top of the caller's nested state dict.
        *parents, last = self.mappings[fqn]
        node: Any = self.original_state_dict
        for key in parents:
            node = node[key]
        node[last] = obj


def check_data_lengths(checkpoint_dir: str | os.PathLike[str], metadata: Metadata, *, prefix: str = "") -> None:
    """Every data file that ``metadata`` points into (of those whose names start with ``prefix``: one rank's,
    after it wrote them) exists and is as long as the metadata says; errors name the file. The one rule."""
    root = Path(checkpoint_dir)
    paths = storage_files(root, metadata)  # every path inside the folder before any is looked at
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        if info.relative_path.startswith(prefix):
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(needed.items()):
        path = paths[rel]
        if not path.is_file():
            raise FileNotFoundError(missing_message(path))
        size = path.stat().st_size
        if size < end:
            raise RuntimeError(f"{path} is truncated ({size} bytes, the metadata needs {end}): re-save the checkpoint.")


def check_data_files(checkpoint_dir: str | os.PathLike[str], metadata: Metadata) -> None:
    """Every data file that ``metadata`` points into exists and is long enough, and the folder's marker holds."""
    check_data_lengths(checkpoint_dir, metadata)
    _check_marker(Path(checkpoint_dir), metadata)


def read_checked_metadata(checkpoint_dir: Path) -> Metadata:
    """The ``.metadata`` of a folder that :func:`resolve_checkpoint_dir` took, checked against its data files
    and marker (:func:`check_data_files`): what every load and merge reads before any item."""
    metadata = read_metadata(checkpoint_dir)
    check_data_files(checkpoint_dir, metadata)
    return metadata


def _check_marker(root: Path, metadata: Metadata) -> None:
    """The marker's files have their recorded sizes, and, if it records any item's checksum, it records every
    item ``.metadata`` places (same file, offset and length): an item it does not list would load unchecked."""
    marker = read_folder_marker(root)
    if marker is None:
        return
    check_sizes(root, marker.files, FOLDER_MARKER)
    for rank in range(marker.world_size):  # every saving rank's data file is one of the folder's records
        if dcp_shard_file_name(rank) not in marker.files:
            raise CheckpointDamagedError(
                f"{root / dcp_shard_file_name(rank)} is missing from {FOLDER_MARKER} (the save had "
                f"{marker.world_size} ranks): the checkpoint is incomplete or its marker was altered. Load another "
                "checkpoint."
            )
    listed = {(rel, offset, length) for rel, record in marker.files.items() for offset, length, _ in record.items}
    if not listed:  # saved without per-item checksums (Accelerate, torch, older fullshard, no ISA-L)
        return
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        if (info.relative_path, info.offset, info.length) not in listed:
            raise _unlisted_item(root, info.relative_path, info.offset, info.length, getattr(index, "fqn", None))


def _unlisted_item(root: Path, rel: str, offset: int, length: int, fqn: str | None = None) -> CheckpointDamagedError:
    what = f"{fqn!r} at" if fqn is not None else "an item at"
    return CheckpointDamagedError(
        f"{root / rel} is damaged: {DCP_METADATA_FILE} places {what} offset {offset} ({length} bytes), but "
        f"{COMPLETE_MARKER} records no item there, so its bytes cannot be checked; the metadata or the marker was "
        "altered. Load another checkpoint (`fullshard verify FOLDER` names every damaged file)."
    )


def _candidate_subfolders(root: Path) -> list[Path]:
    subs = [p for p in root.iterdir() if p.is_dir() and (p / DCP_METADATA_FILE).is_file()]
    # Model folders first: they are what merge_fsdp_weights is usually after.
    return sorted(subs, key=lambda p: (not p.name.startswith(FSDP_MODEL_NAME), p.name))


def resolve_checkpoint_dir(checkpoint_dir: str | os.PathLike[str], *, caller: str) -> Path:
    """Return ``checkpoint_dir`` as a Path if it is a complete DCP folder; otherwise raise saying why.

    Complete means: it has ``.metadata`` and it is not a ``*.incomplete`` staging folder (refused with
    :func:`~fullshard.checkpoint.folder.staging_error`); the completion marker's file sizes are checked with
    the data files (:func:`check_data_files`). See [Note: what a folder is] in ``folder.py``.
    A parent folder of ``pytorch_model_fsdp_0``/``optimizer_0`` is refused with the subfolder to pass.
    """
    if not isinstance(checkpoint_dir, str | os.PathLike):
        raise ValueError(f"{caller}(checkpoint_dir={checkpoint_dir!r}): expected a folder path (str or Path).")
    root = Path(checkpoint_dir)
    where = f"{caller}(checkpoint_dir='{root}')"
    if not root.exists():
        raise FileNotFoundError(f"{where}: no such folder.{missing_hint(root)}")
    if not root.is_dir():
        raise ValueError(f"{where}: this is a file; pass the sharded checkpoint folder.")
    if is_staging_name(root):
        raise staging_error(root, where)
    if not (root / DCP_METADATA_FILE).is_file():
        subs = _candidate_subfolders(root)
        if subs:
            names = " or ".join(f"'{p}'" for p in subs)
            raise ValueError(
                f"{where}: this folder holds no {DCP_METADATA_FILE}; it is the parent of sharded checkpoint "
                f"folder(s). Pass the subfolder instead: {names}."
            )
        if any(root.glob("*.distcp")):
            raise CheckpointDamagedError(
                f"{where}: the checkpoint is incomplete (no {DCP_METADATA_FILE}). Load an earlier checkpoint or "
                "save again."
            )
        raise ValueError(
            f"{where}: this folder is not a sharded checkpoint (it holds no {DCP_METADATA_FILE} and no .distcp "
            "files). Pass the folder save_state wrote for the model, e.g. ckpt/pytorch_model_fsdp_0."
        )
    check_enclosing(root)  # a part of a save_state checkpoint: what a load of that checkpoint checks of it
    return root


def read_every_item(checkpoint_dir: Path, metadata: Metadata, *, share: tuple[int, int] = (0, 1)) -> None:
    """Read every stored value of a folder that :func:`read_checked_metadata` took, one at a time, as a load
    reads it (:class:`SafeFileSystemReader`: checked reads, the safe planner), and drop it: what ``verify`` runs
    so that it refuses what a load refuses. ``share=(rank, world)``: every ``world``-th value from ``rank``."""
    reader = SafeFileSystemReader(checkpoint_dir, metadata)
    rank, world = share
    for i, (fqn, md) in enumerate(sorted(metadata.state_dict_metadata.items())):
        if i % world != rank:
            continue
        tensor = isinstance(md, TensorStorageMetadata)
        state = {fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype) if tensor else None}
        try:
            load_checked(state, reader, no_dist=True)
        except CheckpointDamagedError:
            raise
        except (Exception, dcp.CheckpointException) as exc:  # CheckpointException is a BaseException
            raise CheckpointDamagedError(
                f"{checkpoint_dir}: the stored value of {fqn!r} cannot be read ({read_error_line(exc)}); the "
                "checkpoint is damaged. Load another checkpoint."
            ) from None


def read_error_line(exc: BaseException) -> str:
    """A failed read in one line: DCP's wrapper unwrapped to the first rank's error, its first sentence only (torch's
    unpickling errors go on to suggest ``weights_only=False``, which fullshard never uses)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) and isinstance(first[0], BaseException) else exc
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0].split('. ')[0] if lines else ''}"

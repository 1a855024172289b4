"""Read DCP tensor items from disk straight into their target tensors: one copy, from the page cache.

torch's ``FileSystemReader.read_data`` loads every stored tensor with ``torch.load`` into a fresh tensor
(the kernel zero-fills its pages, then the file's bytes are copied in) and copies that into the target:
three passes over memory per byte read, plus page faults, which on a busy 2-core machine make a cold load
CPU-bound at a fraction of the disk's read bandwidth.

[Note: direct tensor reads]
Each DCP tensor item is a ``torch.save`` archive (a zip with ``data.pkl`` and the storage bytes stored
uncompressed). :func:`locate` unpickles it with ``map_location="meta"`` (``weights_only=True``, as everywhere
in fullshard), which reads only ``data.pkl`` and the zip directory and tells where the storage bytes start
(``storage._checkpoint_offset``), with the stored tensor's dtype, shape, strides and storage offset. When the
stored tensor is contiguous and the request takes whole rows of it (every dimension after the first in
full: what ``Shard(0)`` resharding asks for), the requested bytes are one contiguous range of the file, and
:func:`read_item_into` reads them with ``readinto`` directly into the target (or, for a non-contiguous
target or another dtype, into one contiguous buffer that is then copied). Anything else (transforms,
column slices, strided storage) returns ``False`` and the caller falls back to torch's path. The bytes are
the same either way; this only removes copies.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import torch

__all__ = ["ItemView", "StoredTensor", "advise_sequential", "locate", "read_exactly", "read_item_into"]


class ItemView(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of ``file`` from ``start`` (one DCP item)."""

    def __init__(self, file: io.RawIOBase, start: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._pos = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = min(max(0, base + offset), self._length)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: max(0, self._length - self._pos)]
        if not len(view):
            return 0
        self._file.seek(self._start + self._pos)
        got = self._file.readinto(view) or 0
        self._pos += got
        return got


@dataclass(frozen=True)
class StoredTensor:
    """Where a stored tensor's bytes are in its item (``offset``), and its layout."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    contiguous: bool


def locate(item: IO[bytes]) -> StoredTensor | None:
    """The layout of the ``torch.save``'d tensor in ``item`` (a seekable view of one DCP item), reading no data.

    ``None`` if the item is not a plain tensor whose storage starts at its first element.
    """
    meta = torch.load(item, map_location="meta", weights_only=True)
    if not isinstance(meta, torch.Tensor) or type(meta) is not torch.Tensor:
        return None
    offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    if offset is None or meta.storage_offset() != 0:
        return None
    return StoredTensor(int(offset), meta.dtype, tuple(meta.shape), meta.is_contiguous())


def read_exactly(file: io.RawIOBase, position: int, view: memoryview) -> None:
    """Fill ``view`` with the bytes of ``file`` from ``position``; a short file raises naming it."""
    file.seek(position)
    done = 0
    while done < len(view):
        got = file.readinto(view[done:])
        if not got:
            name = getattr(file, "name", file)
            raise OSError(f"{name} ended {len(view) - done} bytes early reading at {position}: the file is truncated.")
        done += got


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")


def read_item_into(
    file: io.RawIOBase,
    item_offset: int,
    stored: StoredTensor,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    target: torch.Tensor,
    *,
    seen: Callable[[int, memoryview], None] | None = None,
) -> bool:
    """Read rows ``offsets[0] : offsets[0] + lengths[0]`` of the stored tensor into ``target``; ``False`` if the
    request is not one contiguous byte range (see [Note: direct tensor reads]) and nothing was read.

    ``seen`` is given where in the file the bytes read start and the bytes as read (before any dtype
    conversion), e.g. to checksum them; it is not called when nothing is read (an empty request)."""
    shape = stored.shape
    if not stored.contiguous or len(shape) != len(lengths) or tuple(target.shape) != tuple(lengths):
        return False
    if any(o != 0 or n != s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:], strict=True)):
        return False  # a column slice: not one byte range
    element = stored.dtype.itemsize
    row = math.prod(shape[1:]) * element
    start = item_offset + stored.offset + (offsets[0] * row if shape else 0)
    count = math.prod(lengths)
    if count == 0:
        return True
    direct = target.is_contiguous() and target.dtype == stored.dtype and target.device.type == "cpu"
    buffer = target if direct else torch.empty(lengths, dtype=stored.dtype)
    view = _byte_view(buffer)
    read_exactly(file, start, view)
    if seen is not None:
        seen(start, view)
    if not direct:
        target.copy_(buffer)
    return True


def advise_sequential(file: io.RawIOBase) -> None:
    """Ask the kernel for aggressive read-ahead on ``file`` (a no-op where ``posix_fadvise`` is missing)."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)

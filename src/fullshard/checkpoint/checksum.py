"""CRC-32 checksums computed while checkpoint files are written, not in a second pass over the disk.

:class:`ChecksumStream` wraps a binary file: every ``write`` updates a running CRC-32 and a byte count before
passing the bytes on. The CRC-32 is zlib's (``zlib.crc32``), computed by ISA-L (``isal.isal_zlib.crc32``, the
same values, about 4x faster) when the ``isal`` package is installed; files written with either verify with
either. DCP's data files and
``.metadata`` go through :class:`ChecksummingFileSystemWriter`, a ``FileSystemWriter`` whose file system
hands DCP such streams and remembers each file's :class:`~fullshard.checkpoint.manifest.FileRecord`; small
files (scheduler, sampler, RNG states, ...) go through :func:`save_with_checksum`. Cost: one pass over bytes
already in memory: about 2.5-3.5 GB/s per core with zlib, 9 GB/s with ISA-L (``docs/benchmarks.md`` has
the measured share of a save).

:func:`file_checksum` recomputes a file's record from disk, for ``verify``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import io
import os
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from fullshard.checkpoint.files import create_exclusive, with_filename
from fullshard.checkpoint.manifest import FileRecord, ItemChecksum

__all__ = [
    "CRC32_IMPLEMENTATION",
    "ChecksumStream",
    "crc32",
    "crc32_combine",
    "item_checksums",
    "ChecksummingFileSystemWriter",
    "file_checksum",
    "save_with_checksum",
]

try:  # ISA-L's CRC-32 is the same function as zlib's (same values), about 4x faster where installed
    from isal.isal_zlib import crc32 as _crc32
    from isal.isal_zlib import crc32_combine

    CRC32_IMPLEMENTATION = "isal"
except ImportError:
    from zlib import crc32 as _crc32

    crc32_combine = None  # Python's zlib lacks it: no per-item checksums are recorded (checked reads are off)
    CRC32_IMPLEMENTATION = "zlib"

_READ_CHUNK = 16 << 20
_WRITE_BEHIND_WINDOW = 64 << 20


def _libc_sync_file_range() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4


class WriteBehind:
    """Keeps the disk writing while a large file is produced, and its pages out of the page cache.

    [Note: write-behind]
    Written data sits in the page cache until the kernel's background writeback starts (10% of memory dirty by
    default: gigabytes) or until DCP's fsync at the end of each file; the disk idles while the file is
    serialised and then works alone during the fsync. Every ``_WRITE_BEHIND_WINDOW`` bytes, :meth:`advance`
    starts the writeback of the window just written (``sync_file_range(WRITE)``, asynchronous), waits for the
    window before it to reach the disk, and drops that one from the page cache (``POSIX_FADV_DONTNEED``):
    serialising and writing overlap, at most two windows per file are dirty, and the final fsync only waits
    for the last. Durability is unchanged: the fsync still runs. Where ``sync_file_range`` is missing (not
    Linux) this does nothing.
    """

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._kicked = 0  # bytes whose writeback was started
        self._done = 0  # bytes known to be on disk and dropped from the cache

    def advance(self, written: int) -> None:
        if _SYNC_FILE_RANGE is None or written - self._kicked < _WRITE_BEHIND_WINDOW:
            return
        self._raw.flush()
        fd = self._raw.fileno()
        if self._kicked > self._done:  # the previous window: wait for it, then drop it from the cache
            self._sync(fd, self._done, self._kicked - self._done, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, self._done, self._kicked - self._done, os.POSIX_FADV_DONTNEED)
            self._done = self._kicked
        self._sync(fd, self._kicked, written - self._kicked, _SFR_WRITE)
        self._kicked = written

    def _sync(self, fd: int, start: int, length: int, flags: int) -> None:
        if _SYNC_FILE_RANGE(fd, start, length, flags) != 0:  # a disk error surfaces here, before the fsync
            errno = ctypes.get_errno()
            raise OSError(errno, f"{os.strerror(errno)} writing {getattr(self._raw, 'name', fd)}")


def crc32(data: Any, value: int = 0) -> int:
    """zlib's CRC-32 of ``data`` (any buffer), continuing from ``value``."""
    return _crc32(memoryview(data).cast("B"), value)


class ChecksumStream(io.RawIOBase):
    """A write-only binary stream over ``raw`` that checksums and counts what passes through it.

    With ``pieces``, it also keeps each ``write``'s ``(start, length, crc32)``, from which
    :func:`item_checksums` derives the CRC-32 of any span that begins and ends between two writes.
    """

    def __init__(self, raw: Any, *, write_behind: bool = False, pieces: bool = False) -> None:
        super().__init__()
        self.raw = raw
        self.crc32 = 0
        self.size = 0
        self.pieces: list[tuple[int, int, int]] | None = [] if pieces and crc32_combine is not None else None
        self._behind = WriteBehind(raw) if write_behind else None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.pieces is not None and len(view):
            piece = _crc32(view)
            self.pieces.append((self.size, len(view), piece))
            self.crc32 = crc32_combine(self.crc32, piece, len(view))
        else:
            self.crc32 = _crc32(view, self.crc32)
        written = self.raw.write(view)
        # A raw file may write less than asked; buffered ones (what open() returns here) never do.
        if written is not None and written != len(view):
            raise OSError(f"short write to {getattr(self.raw, 'name', self.raw)}: {written} of {len(view)} bytes")
        self.size += len(view)
        if self._behind is not None:
            self._behind.advance(self.size)
        return len(view)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()

    @property
    def record(self) -> FileRecord:
        return FileRecord(self.size, self.crc32)


def item_checksums(pieces: list[tuple[int, int, int]], spans: list[tuple[int, int]]) -> tuple[ItemChecksum, ...]:
    """``(offset, length, crc32)`` of each span ``(offset, length)`` of a file written in ``pieces`` (see
    :class:`ChecksumStream`); spans that do not start and end at a piece boundary are left out."""
    starts = {start: i for i, (start, _, _) in enumerate(pieces)}
    out = []
    for offset, length in sorted(set(spans)):
        i, crc, covered = starts.get(offset), 0, 0
        while i is not None and i < len(pieces) and covered < length:
            _, size, piece = pieces[i]
            crc, covered, i = crc32_combine(crc, piece, size), covered + size, i + 1
        if i is not None and covered == length:
            out.append((offset, length, crc))
    return tuple(out)


class _ChecksumFileSystem(FileSystem):
    """DCP's local file system, except that files opened for writing are :class:`ChecksumStream`s."""

    def __init__(self) -> None:
        self.records: dict[str, FileRecord] = {}
        self.pieces: dict[str, list[tuple[int, int, int]]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with create_exclusive(path) as raw:  # see [Note: exclusive creation] in files.py
                stream = ChecksumStream(raw, write_behind=True, pieces=True)
                yield stream  # DCP may close it (after fsync) before the block ends
                self.records[Path(path).name] = stream.record
                if stream.pieces is not None:
                    self.pieces[Path(path).name] = stream.pieces
        except Exception as exc:  # a full disk names the file: see [Note: naming a full disk] in files.py
            named = with_filename(exc, path)
            if named is exc:
                raise
            raise named from exc

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)  # DCP writes .metadata.tmp, then renames it
        record = self.records.pop(Path(path).name, None)
        if record is not None:
            self.records[Path(new_path).name] = record


class ChecksummingFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` that records every file it writes (name -> size, CRC-32 and, for data files, each
    stored item's CRC-32) in :attr:`records`.

    On each rank, :attr:`records` holds that rank's data files (and ``.metadata`` on the coordinator).
    """

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _ChecksumFileSystem()
        self._spans: dict[str, list[tuple[int, int]]] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        def note_spans(done: Future[list[WriteResult]]) -> list[WriteResult]:
            results = done.value()
            for result in results:
                info = result.storage_data
                self._spans.setdefault(Path(info.relative_path).name, []).append((info.offset, info.length))
            return results

        return super().write_data(plan, planner).then(note_spans)

    @property
    def records(self) -> dict[str, FileRecord]:
        records = dict(self.fs.records)
        for name, spans in self._spans.items():
            pieces = self.fs.pieces.get(name)
            if name in records and pieces is not None:
                records[name] = dataclasses.replace(records[name], items=item_checksums(pieces, spans))
        return records


def save_with_checksum(obj: Any, path: str | os.PathLike[str]) -> FileRecord:
    """``torch.save(obj, path)`` into a new file, fsync'd, returning the file's size and CRC-32 as written.

    The file is created exclusively ([Note: exclusive creation] in ``files.py``); a failed write raises an
    ``OSError`` naming ``path`` when the cause was one (torch reports a full disk as ``unexpected pos``).
    """
    try:
        with create_exclusive(path) as raw:
            stream = ChecksumStream(raw)
            torch.save(obj, stream)
            raw.flush()
            os.fsync(raw.fileno())
    except Exception as exc:
        named = with_filename(exc, path)
        if named is exc:
            raise
        raise named from exc
    return stream.record


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_READ_CHUNK):
            yield chunk


def file_checksum(path: str | os.PathLike[str]) -> FileRecord:
    """The size and CRC-32 of ``path`` as it is on disk now."""
    crc, size = 0, 0
    for chunk in _chunks(Path(path)):
        crc = _crc32(chunk, crc)
        size += len(chunk)
    return FileRecord(size, crc)

"""Fast checkpoint I/O: direct tensor reads (checkpoint/direct_read.py) and write-behind (checkpoint/checksum.py).

See [Note: direct tensor reads]. Single process, tiny tensors: the path is the same at any size.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fullshard.checkpoint import direct_read
from fullshard.checkpoint.dcp import load_sharded, save_sharded
from fullshard.checkpoint.direct_read import ItemView, locate, read_item_into
from fullshard.checkpoint.reader import quiet_single_process_warning, read_metadata


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(6, 5, generator=g),
        "b": torch.randn(7, generator=g),
        "h": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "step": torch.tensor(3.0),  # 0-d
        "n": torch.arange(10),
    }


def _first_item(folder: Path, fqn: str) -> tuple[Path, int, int]:
    md = read_metadata(folder)
    (info,) = [info for index, info in md.storage_data.items() if index.fqn == fqn]
    return folder / info.relative_path, info.offset, info.length


def test_load_reads_every_tensor_directly_and_equals_what_was_saved(tmp_path: Path, monkeypatch) -> None:
    saved = _state()
    save_sharded({"model": {k: v.clone() for k, v in saved.items()}}, tmp_path / "ck")
    calls = []
    real = direct_read.read_item_into
    monkeypatch.setattr(
        "fullshard.checkpoint.reader.read_item_into", lambda *a, **k: calls.append(a[-1].shape) or real(*a, **k)
    )
    target = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
    target["model"]["w"] = torch.zeros(5, 6).t()  # a non-contiguous target: read into a buffer, then copied
    load_sharded(target, tmp_path / "ck")
    assert len(calls) == len(saved), "every tensor item took the direct path"
    for key, value in saved.items():
        assert torch.equal(target["model"][key], value), key


def test_row_ranges_are_read_from_the_middle_of_the_item_and_column_slices_are_refused(tmp_path: Path) -> None:
    weight = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    with quiet_single_process_warning():
        dcp.save({"w": weight}, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    path, offset, length = _first_item(tmp_path, "w")
    with open(path, "rb", buffering=0) as f:
        stored = locate(ItemView(f, offset, length))
        assert stored is not None and stored.shape == (8, 6) and stored.contiguous
        rows = torch.empty(3, 6)
        assert read_item_into(f, offset, stored, (2, 0), (3, 6), rows)
        assert torch.equal(rows, weight[2:5])
        cols = torch.full((8, 2), -1.0)
        assert not read_item_into(f, offset, stored, (0, 1), (8, 2), cols), "a column slice is not one byte range"
        assert bool((cols == -1).all()), "nothing was read when refused"


def test_a_truncated_item_raises_naming_the_file(tmp_path: Path) -> None:
    weight = torch.randn(64, 64)
    with quiet_single_process_warning():
        dcp.save({"w": weight}, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    path, offset, length = _first_item(tmp_path, "w")
    with open(path, "rb", buffering=0) as f:
        stored = locate(ItemView(f, offset, length))
    data = path.read_bytes()
    cut = offset + stored.offset + 1000  # inside the tensor's bytes
    path.write_bytes(data[:cut])
    with open(path, "rb", buffering=0) as f, pytest.raises(OSError, match=r"ended .* bytes early.*truncated"):
        read_item_into(f, offset, stored, (0, 0), (64, 64), torch.empty(64, 64))


def test_write_behind_starts_writeback_per_window_and_keeps_bytes_and_checksum(tmp_path: Path, monkeypatch) -> None:
    from fullshard.checkpoint import checksum

    if checksum._SYNC_FILE_RANGE is None:
        pytest.skip("sync_file_range is Linux-only")
    calls = []
    real = checksum._SYNC_FILE_RANGE
    monkeypatch.setattr(checksum, "_SYNC_FILE_RANGE", lambda *a: calls.append(a[1:]) or real(*a))
    monkeypatch.setattr(checksum, "_WRITE_BEHIND_WINDOW", 4096)
    data = torch.randint(0, 256, (50_000,), dtype=torch.uint8).numpy().tobytes()
    path = tmp_path / "f.bin"
    with open(path, "wb") as raw:
        stream = checksum.ChecksumStream(raw, write_behind=True)
        for i in range(0, len(data), 3000):
            stream.write(data[i : i + 3000])
        raw.flush()
    assert path.read_bytes() == data
    assert stream.record == checksum.file_checksum(path)
    started = [(start, length) for start, length, flags in calls if flags == checksum._SFR_WRITE]
    waited = [(start, length) for start, length, flags in calls if flags != checksum._SFR_WRITE]
    assert len(started) >= 5 and started[0][0] == 0, "writeback started window after window, from the start"
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(started)), "windows are contiguous"
    assert waited == started[:-1], "each window is waited for once the next one started"


def test_a_write_behind_error_raises_naming_the_file(tmp_path: Path, monkeypatch) -> None:
    from fullshard.checkpoint import checksum

    monkeypatch.setattr(checksum, "_SYNC_FILE_RANGE", lambda *a: -1)
    monkeypatch.setattr(checksum, "_WRITE_BEHIND_WINDOW", 16)
    with open(tmp_path / "f.bin", "wb") as raw, pytest.raises(OSError, match=r"f\.bin"):
        checksum.ChecksumStream(raw, write_behind=True).write(b"x" * 64)


def test_views_are_saved_without_a_copy_and_read_back_exactly(tmp_path: Path, monkeypatch) -> None:
    flat = torch.randn(1000)  # a unit's flat shard: the sharded parameters are views of it
    state = {"model": {"a": flat[0:600].view(20, 30), "b": flat[600:1000], "own": torch.randn(7)}}
    clones = []
    real_clone = torch.Tensor.clone
    monkeypatch.setattr(
        torch.Tensor, "clone", lambda self, *a, **k: clones.append(self.shape) or real_clone(self, *a, **k)
    )
    save_sharded(state, tmp_path / "ck")
    monkeypatch.undo()
    assert clones == [], "DCP's writer copied a view before writing it"
    assert (tmp_path / "ck" / "__0_0.distcp").stat().st_size < 1007 * 4 + 3 * 2048, (
        "each view wrote its own bytes, not the whole flat shard"
    )
    target = {"model": {"a": torch.zeros(20, 30), "b": torch.zeros(400), "own": torch.zeros(7)}}
    load_sharded(target, tmp_path / "ck")
    for key, value in state["model"].items():
        assert torch.equal(target["model"][key], value), key

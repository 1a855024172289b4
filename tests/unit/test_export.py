"""Weights export: size strings, shard planning, the streaming safetensors writer, index layout, .bin files."""

from __future__ import annotations

import gc
import json
import re
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fullshard.checkpoint.export import (
    TensorSpec,
    parse_size,
    plan_shards,
    save_weights,
    verify_weights,
    write_safetensors,
)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 4, generator=g)
    return {
        "a.weight": torch.randn(8, 4, generator=g),
        "a.bias": torch.randn(3, generator=g).to(torch.bfloat16),
        "half": torch.randn(5, generator=g).to(torch.float16),
        "ids": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "transposed": base.t(),  # non-contiguous
        "u8": torch.arange(5, dtype=torch.uint8),
    }


def _assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize(
    ("size", "expected"),
    [(123, 123), ("5GB", 5 * 10**9), ("5GiB", 5 * 2**30), ("500MB", 500 * 10**6), ("10KiB", 10240), ("1.5 kB", 1500),
     # estimate-memory's sizes (--budget, --baseline): any case, K/M/G/T, a bare number, a leading point
     ("8gib", 8 * 2**30), ("7.5 GB", 7_500_000_000), ("512MiB", 512 * 2**20), ("2g", 2 * 10**9), (".5K", 500),
     ("123", 123)],
)  # fmt: skip
def test_parse_size(size: int | str, expected: int) -> None:
    assert parse_size(size) == expected


def test_parse_size_minimum() -> None:
    assert parse_size("0", arg="--baseline", minimum=0) == 0
    with pytest.raises(ValueError, match=re.escape("--budget='0': the size must be at least 1024 bytes.")):
        parse_size("0", arg="--budget", minimum=1024)


@pytest.mark.parametrize("size", ["5Gb", "5Mb", "five GB", "", "10XB", "5.", "-3", True, 0, -3, 1.5])
def test_parse_size_rejects(size: object) -> None:
    with pytest.raises(ValueError, match=re.escape(f"max_shard_size={size!r}: ")):
        parse_size(size)  # type: ignore[arg-type]


def test_plan_shards_keeps_order_and_gives_big_tensors_their_own_shard() -> None:
    specs = [TensorSpec(n, torch.float32, (s,)) for n, s in [("a", 2), ("b", 2), ("big", 10), ("c", 1), ("d", 3)]]
    shards = plan_shards(specs, 16)  # bytes: 8, 8, 40, 4, 12
    assert [[s.name for s in shard] for shard in shards] == [["a", "b"], ["big"], ["c", "d"]]
    assert plan_shards(specs, None) == [specs]


def test_single_safetensors_file_is_bitwise_equal(tmp_path: Path) -> None:
    state = _state()
    files = save_weights(state, tmp_path)
    assert files == [tmp_path / "model.safetensors"]
    _assert_bitwise_equal(load_file(files[0]), state)
    with safe_open(files[0], "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no partial files left


def test_tied_and_view_tensors_are_written_as_copies(tmp_path: Path) -> None:
    # safetensors' save_file refuses these (shared storage); each name gets its own bytes here.
    embed = torch.randn(4, 3)
    fused = torch.randn(6, 3)
    state = {"embed.weight": embed, "lm_head.weight": embed, "q": fused[:3], "k": fused[3:]}
    files = save_weights(state, tmp_path)
    loaded = load_file(files[0])
    _assert_bitwise_equal(loaded, state)
    loaded["embed.weight"].add_(1)
    assert not torch.equal(loaded["embed.weight"], loaded["lm_head.weight"])  # no aliasing on load


def test_sharded_safetensors_index_layout(tmp_path: Path) -> None:
    # - Set up: ~1 KB of tensors, 300-byte shards
    state = {f"layers.{i}.weight": torch.full((5, 10), float(i)) for i in range(5)}  # 200 bytes each
    state["small"] = torch.ones(3)
    # - Run
    files = save_weights(state, tmp_path, max_shard_size=300)
    # - Check: HF layout, every tensor in the file the index names
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert files[-1].name == "model.safetensors.index.json"
    assert index["metadata"]["total_size"] == 5 * 200 + 12
    names = sorted({p.name for p in files[:-1]})
    assert names == [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]
    assert set(index["weight_map"].values()) == set(names)
    merged: dict[str, torch.Tensor] = {}
    for name, file in index["weight_map"].items():
        merged[name] = load_file(tmp_path / file)[name]
    _assert_bitwise_equal(merged, state)
    assert not (tmp_path / "model.safetensors").exists()


def test_reexport_removes_stale_shards(tmp_path: Path) -> None:
    state = {f"w{i}": torch.zeros(25) for i in range(4)}  # 100 bytes each
    save_weights(state, tmp_path, max_shard_size=100)
    assert len(list(tmp_path.glob("model-*.safetensors"))) == 4
    save_weights(state, tmp_path, max_shard_size="200B")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    save_weights(state, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize("max_shard_size", [None, 150])
def test_pytorch_model_bin(tmp_path: Path, max_shard_size: int | None) -> None:
    state = {f"w{i}": torch.randn(25) for i in range(3)} | {"view": torch.arange(100.0)[10:12]}
    files = save_weights(state, tmp_path, safe_serialization=False, max_shard_size=max_shard_size)
    loaded: dict[str, torch.Tensor] = {}
    for file in files:
        if file.name.endswith(".bin"):
            loaded |= torch.load(file, weights_only=True)
    _assert_bitwise_equal(loaded, state)
    if max_shard_size is None:
        assert [f.name for f in files] == ["pytorch_model.bin"]
    else:
        assert files[-1].name == "pytorch_model.bin.index.json"
        assert files[0].name == "pytorch_model-00001-of-00003.bin"
    # the 2-element view was cloned, not saved with its 100-element storage
    assert loaded["view"].untyped_storage().nbytes() == 8


def test_writer_holds_one_tensor_at_a_time(tmp_path: Path) -> None:
    specs = [TensorSpec(f"t{i}", torch.float32, (1000,)) for i in range(5)]
    alive: list[weakref.ref[torch.Tensor]] = []

    def fetch(name: str) -> torch.Tensor:
        gc.collect()
        assert all(ref() is None for ref in alive), "the writer kept an earlier tensor alive"
        tensor = torch.full((1000,), float(name[1:]))
        alive.append(weakref.ref(tensor))
        return tensor

    write_safetensors(tmp_path / "x.safetensors", specs, fetch)
    loaded = load_file(tmp_path / "x.safetensors")
    assert [loaded[f"t{i}"][0].item() for i in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_errors_name_the_tensor(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("tensor 'c' has dtype torch.complex128, which safetensors cannot")):
        save_weights({"c": torch.zeros(2, dtype=torch.complex128)}, tmp_path)
    with pytest.raises(ValueError, match=re.escape("save_weights: 'x' is a list, not a tensor")):
        save_weights({"x": [1, 2]}, tmp_path)  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []


def test_verify_weights_detects_truncation(tmp_path: Path) -> None:
    state = _state()
    files = save_weights(state, tmp_path)
    specs = [TensorSpec.of(k, v) for k, v in state.items()]
    verify_weights(files, specs)
    with pytest.raises(RuntimeError, match=re.escape("missing ['extra']")):
        verify_weights(files, [*specs, TensorSpec("extra", torch.float32, (1,))])
    data = files[0].read_bytes()
    files[0].write_bytes(data[:-4])
    with pytest.raises(RuntimeError, match=re.escape(f"{files[0]} is {len(data) - 4} bytes")):
        verify_weights(files, specs)

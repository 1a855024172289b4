"""Write full weights as ``model.safetensors`` / ``pytorch_model.bin``, split into shards above a size limit.

The on-disk result is what the Hugging Face loaders read:

- one file, ``model.safetensors`` (or ``pytorch_model.bin``), when everything fits in ``max_shard_size``;
- otherwise ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``
  (``{"metadata": {"total_size": <bytes of tensor data>}, "weight_map": {name: file}}``), and the same with
  ``pytorch_model-0000i-of-0000N.bin`` / ``pytorch_model.bin.index.json`` for pickles.

[Note: streaming safetensors writer]
safetensors' own ``save_file`` needs every tensor in memory at once. The format is simple enough to write
ourselves: 8 bytes little-endian header length, a JSON header ``{name: {"dtype", "shape", "data_offsets"}}``
(offsets relative to the end of the header), then the raw little-endian bytes. Everything in the header is
known from dtypes and shapes alone, so :func:`write_safetensors` writes the header first and then asks
``fetch(name)`` for one tensor at a time: peak memory is one tensor, whatever the file size. ``merge.py``
uses this with a fetch that reads one tensor from a sharded checkpoint.

Tied or shared storage: safetensors' ``save_file`` refuses tensors that share memory. Here every name is
written with its own copy of the bytes, so tied weights (``lm_head.weight`` is ``embed.weight``) come out as
two equal entries; loaders re-tie them. Nothing is dropped and nothing aliases on disk.

Sizes (:func:`parse_size`, also behind ``get_max_memory`` and ``estimate-memory --budget``): an int is bytes. A
string is a number and a unit in any case; decimal units are powers of 10 and binary units powers of 2, as in
Hugging Face: ``"5GB" == 5 * 10**9``, ``"5GiB" == 5 * 2**30``, ``"10KiB" == 10240``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fullshard.checkpoint.checksum import WriteBehind
from fullshard.checkpoint.files import (
    NoSpaceError,
    create_exclusive,
    find_os_error,
    free_bytes,
    new_folders,
    remove_new_folders,
    temporary_name,
)
from fullshard.checkpoint.names import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    weights_shard_file_name,
)

__all__ = [
    "TensorSpec",
    "parse_size",
    "plan_shards",
    "safetensors_dtype",
    "save_weights",
    "verify_weights",
    "write_safetensors",
    "write_weights",
]

# Units of a size, in capitals (any case is accepted); decimal units are powers of 10, *iB units powers of 2.
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
          "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d*\.?\d+)\s*([A-Za-z]*)\s*$")

# safetensors dtype names (format spec); getattr keeps older torch builds without some dtypes working.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    dtype: name
    for attr, name in (
        ("float64", "F64"),
        ("float32", "F32"),
        ("float16", "F16"),
        ("bfloat16", "BF16"),
        ("int64", "I64"),
        ("int32", "I32"),
        ("int16", "I16"),
        ("int8", "I8"),
        ("uint8", "U8"),
        ("bool", "BOOL"),
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
        ("complex64", "C64"),
        ("uint16", "U16"),
        ("uint32", "U32"),
        ("uint64", "U64"),
    )
    if isinstance(dtype := getattr(torch, attr, None), torch.dtype)
}
_SHARD_FILE_RE = re.compile(r"^(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)$")


@dataclass(frozen=True)
class TensorSpec:
    """What a writer needs to know about one tensor before reading its data: name, dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tensor.dtype, tuple(tensor.shape))


def parse_size(size: int | str, *, arg: str = "max_shard_size", minimum: int = 1) -> int:
    """Bytes in ``size``: an int, or a number and a unit in any case: ``"5GB"`` (5*10**9), ``"5GiB"`` (5*2**30),
    ``"7.5 gb"``, ``"512M"``, ``"123"``. ``"5Gb"`` (a capital and a small b) reads as bits, which are refused.
    ValueError (naming ``arg``) for anything else or a size below ``minimum``."""
    match = _SIZE_RE.match(size) if isinstance(size, str) else None
    unit = match.group(2) if match else ""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif match and unit.upper() in _UNITS and not (len(unit) == 2 and unit[0].isupper() and unit[1] == "b"):
        value = int(float(match.group(1)) * _UNITS[unit.upper()])
    else:
        raise ValueError(
            f"{arg}={size!r}: expected a byte count (int) or a string like '5GB' or '500MiB'. Units, in any case: "
            "B, KB (or K), MB (M), GB (G), TB (T), KiB, MiB, GiB, TiB (decimal units are powers of 10, *iB units "
            "powers of 2; bits are not accepted)."
        )
    if value < minimum:
        least = "positive" if minimum == 1 else f"at least {minimum} bytes"
        raise ValueError(f"{arg}={size!r}: the size must be {least}.")
    return value


def safetensors_dtype(dtype: torch.dtype, *, name: str = "") -> str:
    """The safetensors name of ``dtype`` (``torch.float32`` -> ``"F32"``); ValueError if it has none."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        where = f"tensor {name!r}" if name else "tensor"
        raise ValueError(
            f"{where} has dtype {dtype}, which safetensors cannot store. "
            f"Cast it to one of {sorted(str(d) for d in _DTYPE_NAMES)} or pass safe_serialization=False."
        ) from None


def plan_shards(specs: Iterable[TensorSpec], max_shard_size: int | str | None) -> list[list[TensorSpec]]:
    """Split ``specs`` in order into shards of at most ``max_shard_size`` bytes of tensor data.

    A tensor larger than the limit gets a shard of its own (tensors are never split). ``None`` means one shard.
    Invariant: concatenating the returned lists gives ``specs`` back, in order.
    """
    specs = list(specs)
    if max_shard_size is None:
        return [specs]
    limit = parse_size(max_shard_size)
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        if shards[-1] and used + spec.nbytes > limit:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += spec.nbytes
    return shards


def _file_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    # Widest dtypes first keeps every tensor's data aligned to its element size (the header is padded to 8).
    return sorted(specs, key=lambda s: -s.dtype.itemsize)


def safetensors_header(specs: list[TensorSpec], metadata: Mapping[str, str] | None = None) -> bytes:
    """The header bytes (length prefix included) of a safetensors file holding ``specs`` in that order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for spec in specs:
        if spec.name in header:
            raise ValueError(f"tensor name {spec.name!r} appears twice; names in one file must be unique.")
        header[spec.name] = {
            "dtype": safetensors_dtype(spec.dtype, name=spec.name),
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)  # pad so that the data starts 8-byte aligned
    return struct.pack("<Q", len(body)) + body


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    # reshape(-1) also covers 0-d tensors, which .view(uint8) refuses.
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def _fetch_checked(fetch: Callable[[str], torch.Tensor], spec: TensorSpec) -> torch.Tensor:
    tensor = fetch(spec.name)
    if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
        raise AssertionError(
            f"fetch({spec.name!r}) returned {tensor.dtype} {tuple(tensor.shape)}, "
            f"but the header was written for {spec.dtype} {spec.shape}"
        )
    return tensor


def write_safetensors(
    path: str | os.PathLike[str],
    specs: list[TensorSpec],
    fetch: Callable[[str], torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
    on_tensor: Callable[[TensorSpec], None] | None = None,
) -> None:
    """Write a safetensors file holding ``specs``, fetching one tensor at a time. See [Note: streaming ...].

    Postcondition: ``safetensors.torch.load_file(path)[s.name]`` equals ``fetch(s.name)`` bitwise for every spec.
    Peak memory is that of the largest single fetched tensor.
    """
    if sys.byteorder != "little":
        raise RuntimeError("write_safetensors: safetensors stores little-endian data; this host is big-endian.")
    specs = _file_order(specs)
    with create_exclusive(path) as f:  # see [Note: exclusive creation] in files.py
        behind = WriteBehind(f)  # the disk writes while the next tensors are read: see [Note: write-behind]
        written = f.write(safetensors_header(specs, metadata))
        for spec in specs:
            tensor = _fetch_checked(fetch, spec)
            written += f.write(_raw_bytes(tensor))
            del tensor
            behind.advance(written)
            if on_tensor is not None:
                on_tensor(spec)
        f.flush()
        os.fsync(f.fileno())  # on disk before write_weights renames it into place


def _write_bin(
    path: Path, specs: list[TensorSpec], fetch: Callable[[str], torch.Tensor], on_tensor: Callable | None
) -> None:
    # torch.save has no streaming writer: one shard's tensors are held at once (bounded by max_shard_size).
    shard: dict[str, torch.Tensor] = {}
    for spec in specs:
        # clone() drops any larger storage the tensor views, which torch.save would otherwise write whole.
        shard[spec.name] = _fetch_checked(fetch, spec).detach().to("cpu").clone()
        if on_tensor is not None:
            on_tensor(spec)
    with create_exclusive(path) as f:
        torch.save(shard, f)
        f.flush()
        os.fsync(f.fileno())


def _remove_stale(output_dir: Path, keep: set[str], safe_serialization: bool) -> None:
    """Remove weight files of an earlier export in the same format, so loaders do not mix two exports."""
    if safe_serialization:
        single, index = SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME
    else:
        single, index = WEIGHTS_NAME, WEIGHTS_INDEX_NAME
    ext = ".safetensors" if safe_serialization else ".bin"
    for entry in output_dir.iterdir():
        stale = entry.name in (single, index) or (_SHARD_FILE_RE.match(entry.name) and entry.name.endswith(ext))
        if stale and entry.name not in keep and entry.is_file():
            entry.unlink()


def write_weights(
    specs: list[TensorSpec],
    fetch: Callable[[str], torch.Tensor],
    output_dir: str | os.PathLike[str],
    *,
    safe_serialization: bool = True,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    on_tensor: Callable[[TensorSpec], None] | None = None,
) -> list[Path]:
    """Write ``specs`` (data from ``fetch``) into ``output_dir``, sharded above ``max_shard_size``.

    Each file is created anew under a temporary name of its own and renamed when complete ([Note: exclusive
    creation] in ``files.py``); the index (if any) is written last. Returns the written files, index last.
    Files of an earlier export in the same format are removed. On failure nothing is left that was not there
    before (temporary files, folders this call created), and a full disk raises :class:`NoSpaceError` with
    the bytes needed and free.
    """
    out = Path(output_dir)
    created = new_folders(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(specs, max_shard_size)
    names = [_shard_name(i, len(shards), safe_serialization) for i in range(len(shards))]
    written: list[Path] = []
    try:
        for name, shard in zip(names, shards, strict=True):
            tmp = temporary_name(out / name)
            written.append(tmp)
            if safe_serialization:
                write_safetensors(tmp, shard, fetch, metadata=metadata, on_tensor=on_tensor)
            else:
                _write_bin(tmp, shard, fetch, on_tensor)
    except BaseException as exc:
        for tmp in written:
            tmp.unlink(missing_ok=True)
        remove_new_folders(created)
        found = find_os_error(exc)
        if found is not None and found.errno == errno.ENOSPC:
            needed = sum(len(safetensors_header(_file_order(s), metadata)) if safe_serialization else 0 for s in shards)
            needed += sum(spec.nbytes for spec in specs)
            raise NoSpaceError(found.filename or out, needed, free_bytes(out)) from exc
        raise
    final = [out / name for name in names]
    _remove_stale(out, set(names), safe_serialization)
    for tmp, path in zip(written, final, strict=True):
        os.replace(tmp, path)
    if len(shards) > 1:
        final.append(_write_index(out, shards, names, safe_serialization))
    return final


def _shard_name(i: int, num_shards: int, safe_serialization: bool) -> str:
    if num_shards == 1:
        return SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    return weights_shard_file_name(i + 1, num_shards, safe_serialization=safe_serialization)


def _write_index(out: Path, shards: list[list[TensorSpec]], names: list[str], safe_serialization: bool) -> Path:
    weight_map = {spec.name: name for name, shard in zip(names, shards, strict=True) for spec in shard}
    total = sum(spec.nbytes for shard in shards for spec in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    path = out / (SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME)
    tmp = temporary_name(path)
    try:
        with create_exclusive(tmp) as f:
            f.write((json.dumps(index, indent=2, sort_keys=False) + "\n").encode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def save_weights(
    state_dict: Mapping[str, torch.Tensor],
    output_dir: str | os.PathLike[str],
    *,
    safe_serialization: bool = True,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Export a full state dict (name -> plain tensor) into ``output_dir``; returns the files written.

    Tied weights are written once per name (see the module note). Sharded values (DTensor) are refused:
    gather them first, e.g. with ``{k: v.full_tensor() for k, v in sd.items()}`` or a FULL_STATE_DICT.
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"save_weights(state_dict={type(state_dict).__name__}): expected a dict of name -> tensor.")
    specs = [_spec_of(name, value) for name, value in state_dict.items()]
    return write_weights(
        specs,
        state_dict.__getitem__,
        output_dir,
        safe_serialization=safe_serialization,
        max_shard_size=max_shard_size,
        metadata=metadata,
    )


def _spec_of(name: object, value: object) -> TensorSpec:
    if not isinstance(name, str):
        raise ValueError(f"save_weights: key {name!r} is a {type(name).__name__}; weight names must be str.")
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"save_weights: {name!r} is a {type(value).__name__}, not a tensor; export tensors only.")
    if type(value).__name__ == "DTensor" or hasattr(value, "placements"):
        raise ValueError(
            f"save_weights: {name!r} is a sharded DTensor; export full tensors. "
            "Gather first: {k: v.full_tensor() for k, v in state_dict.items()}."
        )
    return TensorSpec.of(name, value)


def verify_weights(files: list[Path], specs: list[TensorSpec], *, safe_serialization: bool = True) -> None:
    """Check that ``files`` hold exactly ``specs`` (names, dtypes, shapes) and are not truncated.

    For safetensors this reads headers only; for ``.bin`` it memory-maps the pickles (weights_only=True).
    Raises RuntimeError naming the file and the first difference.
    """
    expected = {s.name: s for s in specs}
    seen: dict[str, TensorSpec] = {}
    for path in files:
        if path.name.endswith(".index.json"):
            _verify_index(path, expected)
            continue
        found = _read_safetensors_specs(path) if safe_serialization else _read_bin_specs(path)
        for spec in found:
            if spec.name in seen:
                raise RuntimeError(f"verify_weights: {spec.name!r} appears in more than one file (again in {path}).")
            seen[spec.name] = spec
    if seen != expected:
        missing = sorted(set(expected) - set(seen))
        extra = sorted(set(seen) - set(expected))
        changed = sorted(n for n in set(seen) & set(expected) if seen[n] != expected[n])
        raise RuntimeError(
            f"verify_weights({[str(f) for f in files]}): output differs from the source: missing {missing[:10]}, "
            f"unexpected {extra[:10]}, different dtype/shape {changed[:10]}."
        )


def _verify_index(path: Path, expected: Mapping[str, TensorSpec]) -> None:
    weight_map = json.loads(path.read_text())["weight_map"]
    if set(weight_map) != set(expected):
        raise RuntimeError(f"verify_weights: index {path} does not list exactly the merged tensors.")


def _read_safetensors_specs(path: Path) -> list[TensorSpec]:
    names_to_dtype = {v: k for k, v in _DTYPE_NAMES.items()}
    size = path.stat().st_size
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if size != 8 + header_len + end:
        raise RuntimeError(f"verify_weights: {path} is {size} bytes; its header says {8 + header_len + end}.")
    return [TensorSpec(k, names_to_dtype[v["dtype"]], tuple(v["shape"])) for k, v in header.items()]


def _read_bin_specs(path: Path) -> list[TensorSpec]:
    loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return [TensorSpec.of(k, v) for k, v in loaded.items()]

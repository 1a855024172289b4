"""Weights offloaded to disk in Accelerate's folder format, so either library reads the other's folders.

A folder holds ``<name>.dat`` per tensor (its raw bytes, C order; a 0-d tensor as one element; bfloat16 stored
as int16 and float8 as int8, since numpy has neither) and ``index.json``: ``{name: {"dtype": <numpy dtype name
or "bfloat16" / "float8_...">, "shape": [...]}}``.

Invariant: a name is in ``index.json`` only once its ``.dat`` file is completely written. :func:`offload_state_dict`
writes every ``.dat`` first and then replaces the index atomically (merged with the one already there), so a
crash part-way leaves the previous index, describing only complete files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fullshard.frontend.bigmodel.tensors import set_module_tensor_to_device

__all__ = ["load_offloaded_weight", "load_offloaded_weights", "offload_state_dict", "offload_weight"]

_INDEX = "index.json"


def offload_weight(
    weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike[str], index: dict | None = None
) -> dict | None:
    """Write ``weight`` to ``<offload_folder>/<weight_name>.dat``; record it in ``index`` (returned) if given."""
    name = str(weight.dtype).removeprefix("torch.")
    data = weight.detach().cpu().contiguous()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    elif name.startswith("float8_"):
        data = data.view(torch.int8)
    array = data.numpy()
    if index is not None:
        dtype = name if name == "bfloat16" or name.startswith("float8_") else str(array.dtype)
        index[weight_name] = {"dtype": dtype, "shape": list(array.shape)}
    array.reshape(-1).tofile(os.path.join(offload_folder, f"{weight_name}.dat"))
    return index


def load_offloaded_weight(weight_file: str | os.PathLike[str], weight_info: Mapping[str, Any]) -> torch.Tensor:
    """Read one ``.dat`` file described by its ``index.json`` entry; a file of the wrong size is refused."""
    shape, dtype = tuple(weight_info["shape"]), str(weight_info["dtype"])
    stored = "int16" if dtype == "bfloat16" else "int8" if dtype.startswith("float8_") else dtype
    count = int(np.prod(shape)) if shape else 1
    expected = count * np.dtype(stored).itemsize
    actual = os.path.getsize(weight_file)
    if actual != expected:
        raise ValueError(
            f"offloaded weight {weight_file}: {actual} bytes on disk, but its index entry ({dtype}, shape "
            f"{list(shape)}) needs {expected}. The file is truncated or from another model; offload it again."
        )
    array = np.fromfile(weight_file, dtype=stored, count=count).reshape(shape)
    tensor = torch.from_numpy(array)
    if dtype == "bfloat16" or dtype.startswith("float8_"):
        tensor = tensor.view(getattr(torch, dtype))
    return tensor


def offload_state_dict(save_dir: str | os.PathLike[str], state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write every tensor of ``state_dict`` to ``save_dir`` (created if needed); see the module docstring."""
    folder = Path(save_dir)
    folder.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, folder, index)
    path = folder / _INDEX
    merged = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    merged.update(index)
    tmp = path.with_name(_INDEX + ".tmp")
    tmp.write_text(json.dumps(merged, indent=2), encoding="utf-8")
    os.replace(tmp, path)


def load_offloaded_weights(model: nn.Module, index: Mapping[str, Any] | None, offload_folder: str | os.PathLike[str]):
    """Put every weight of ``index`` (an ``index.json``'s content) from ``offload_folder`` into ``model``, on CPU.

    Every file is checked against its entry before the first tensor is set, so a bad folder changes nothing.
    """
    if not index:
        return
    files = {name: os.path.join(offload_folder, f"{name}.dat") for name in index}
    missing = [f for f in files.values() if not os.path.isfile(f)]
    if missing:  # checked before any tensor is set
        raise FileNotFoundError(
            f"load_offloaded_weights: {len(missing)} file(s) of the index are missing: {missing[:3]}"
        )
    weights = {name: load_offloaded_weight(files[name], info) for name, info in index.items()}
    for name, weight in weights.items():
        set_module_tensor_to_device(model, name, "cpu", value=weight)

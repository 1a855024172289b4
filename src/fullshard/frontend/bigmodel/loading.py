"""Loading full checkpoints into one process's model: ``load_state_dict``, ``load_checkpoint_in_model``;
and ``shard_checkpoint``, the split of a state dict into size-limited files (as ``save_model`` writes them).

``load_checkpoint_in_model`` reads what ``fullshard merge-weights`` / ``Accelerator.save_model`` write (and what
Hugging Face libraries write): one ``model.safetensors`` / ``pytorch_model.bin``, or shards with an
``*.index.json``. Before the first tensor is copied, every file is found and every safetensors header read (a
truncated shard fails there), so a bad checkpoint leaves the model as it was.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from fullshard.checkpoint import TensorSpec, plan_shards
from fullshard.frontend.bigmodel import offload as offload_io
from fullshard.frontend.bigmodel.tensors import set_module_tensor_to_device
from fullshard.frontend.bigmodel.tied import device_of, find_tied_parameters, retie_parameters

__all__ = ["checkpoint_files", "load_checkpoint_in_model", "load_state_dict", "shard_checkpoint"]

_SINGLE = ("model.safetensors", "pytorch_model.bin")


def _device(device: Any) -> str | torch.device:
    return f"cuda:{device}" if isinstance(device, int) else device


def load_state_dict(checkpoint_file: str | os.PathLike[str], device_map: Mapping[str, Any] | None = None):
    """The tensors of one ``.safetensors`` or ``.bin`` file, on the CPU, or each on the device ``device_map``
    gives its module (``"disk"`` entries are read to the CPU)."""
    path = str(checkpoint_file)
    if not path.endswith(".safetensors"):
        return torch.load(path, map_location="cpu", weights_only=True)
    tensors = {}
    with safe_open(path, framework="pt") as reader:
        for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
            device = "cpu" if device_map is None else _device(device_of(name, device_map))
            tensors[name] = reader.get_tensor(name).to("cpu" if device == "disk" else device)
    return tensors


def checkpoint_files(checkpoint: str | os.PathLike[str]) -> list[Path]:
    """The weight files of ``checkpoint``: a file, an ``*.index.json``, or a folder holding exactly one index
    or one ``model.safetensors`` / ``pytorch_model.bin``. Every listed file must exist."""
    path = Path(checkpoint)
    if path.is_dir():
        indexes = sorted(path.glob("*.index.json"))
        singles = [path / n for n in _SINGLE if (path / n).is_file()]
        if len(indexes) > 1 or (not indexes and len(singles) != 1):
            found = [p.name for p in [*indexes, *singles]]
            raise ValueError(
                f"load_checkpoint_in_model(checkpoint={str(checkpoint)!r}): expected one *.index.json or one of "
                f"{list(_SINGLE)} in the folder, found {found or 'none'}. Pass the file to load."
            )
        path = indexes[0] if indexes else singles[0]
    if not path.is_file():
        raise FileNotFoundError(f"load_checkpoint_in_model(checkpoint={str(checkpoint)!r}): no such file or folder.")
    if not path.name.endswith(".json"):
        return [path]
    weight_map = json.loads(path.read_text(encoding="utf-8")).get("weight_map", {})
    files = [path.parent / name for name in dict.fromkeys(weight_map.values())]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(
            f"load_checkpoint_in_model: {path.name} lists shard(s) {missing} that are not in {path.parent}. "
            "Copy the whole checkpoint folder."
        )
    return files


def _check_headers(files: list[Path]) -> None:
    for file in files:
        if file.suffix == ".safetensors":
            try:
                with safe_open(str(file), framework="pt"):
                    pass
            except Exception as exc:
                raise ValueError(
                    f"load_checkpoint_in_model: {file} is not a readable safetensors file ({exc})."
                ) from exc


def _names_in(file: Path) -> list[str]:
    if file.suffix != ".safetensors":
        return list(load_state_dict(file))
    with safe_open(str(file), framework="pt") as reader:
        return list(reader.keys())


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Mapping[str, Any] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Copy ``checkpoint``'s tensors into ``model`` (see the module docstring), placing each as ``device_map``
    says (``"disk"``: written to ``offload_folder`` instead). Without a map a tensor keeps its device (``meta``
    ones go to the CPU). ``dtype`` casts floating-point tensors, except under ``keep_in_fp32_modules``.
    Tied parameters are tied again afterwards. Unexpected or missing names warn, or raise with ``strict``.
    ``offload_state_dict``, ``offload_buffers``, ``offload_8bit_bnb`` and the last two are accepted and unused.
    """
    if device_map is not None and "disk" in map(str, device_map.values()) and offload_folder is None:
        raise ValueError("load_checkpoint_in_model: device_map sends weights to 'disk'; pass offload_folder=...")
    files = checkpoint_files(checkpoint)
    _check_headers(files)
    tied = find_tied_parameters(model)
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    expected = dict(named)  # tied names included: a checkpoint lists each of them
    if strict:
        names = {name for file in files for name in _names_in(file)}
        extra, absent = sorted(names - set(expected)), sorted(set(expected) - names)
        if extra or absent:
            raise ValueError(f"load_checkpoint_in_model(strict=True): unexpected names {extra}, missing {absent}.")
    fp32 = list(keep_in_fp32_modules or [])
    loaded, unexpected, to_disk = set(), [], {}
    for file in files:
        for name, value in load_state_dict(file, device_map if device_map else None).items():
            if name not in expected:
                unexpected.append(name)
                continue
            device = device_of(name, device_map) if device_map else expected[name].device
            if str(device) == "meta":
                device = "cpu"
            keep = any(name == m or name.startswith(m + ".") or f".{m}." in f".{name}" for m in fp32)
            cast = torch.float32 if keep and value.is_floating_point() else dtype
            if device == "disk":
                to_disk[name] = value.to(cast) if cast is not None and value.is_floating_point() else value
                continue
            set_module_tensor_to_device(model, name, _device(device), value=value, dtype=cast)
            loaded.add(name)
    if to_disk:
        offload_io.offload_state_dict(offload_folder, to_disk)  # type: ignore[arg-type]
    missing = sorted(set(expected) - loaded - set(to_disk))
    if unexpected or missing:
        warnings.warn(
            f"load_checkpoint_in_model: {len(unexpected)} name(s) of the checkpoint are not in the model "
            f"{unexpected[:5]}, {len(missing)} of the model are not in the checkpoint {missing[:5]}.",
            stacklevel=2,
        )
    retie_parameters(model, tied)


def shard_checkpoint(
    state_dict: Mapping[str, torch.Tensor], max_shard_size: int | str = "10GB", weights_name: str = "pytorch_model.bin"
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any] | None]:
    """Split ``state_dict`` in key order into shards of at most ``max_shard_size`` bytes (a bigger tensor gets a
    shard of its own). Returns ``({file name: part}, index)``; ``index`` is ``None`` for a single shard, else
    ``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}`` (the ``*.index.json`` content)."""
    specs = [TensorSpec.of(name, t) for name, t in state_dict.items()]
    plan = plan_shards(specs, max_shard_size)
    if len(plan) == 1:
        return {weights_name: dict(state_dict)}, None
    stem, dot, ext = weights_name.rpartition(".")
    shards: dict[str, dict[str, torch.Tensor]] = {}
    weight_map: dict[str, str] = {}
    for i, part in enumerate(plan):
        file = f"{stem}-{i + 1:05d}-of-{len(plan):05d}{dot}{ext}"
        shards[file] = {spec.name: state_dict[spec.name] for spec in part}
        weight_map.update(dict.fromkeys(shards[file], file))
    return shards, {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}

"""Big-model utilities against Accelerate's on the same models and inputs, and checkpoint loading against the
files ``save_weights`` (``merge-weights`` / ``save_model``) writes, including broken checkpoints."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from accelerate import utils as acc
from torch import nn

from fullshard.checkpoint import save_weights
from fullshard.frontend.bigmodel.sizes import compute_module_sizes
from fullshard.utils import (
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    infer_auto_device_map,
    load_checkpoint_in_model,
    load_offloaded_weights,
    load_state_dict,
    offload_state_dict,
    retie_parameters,
    set_module_tensor_to_device,
    shard_checkpoint,
)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
        self.register_buffer("scale", torch.ones(width))


class Net(nn.Module):
    """Embedding, blocks, a norm, and a head tied to the embedding when ``tied``."""

    def __init__(self, width: int = 8, depth: int = 3, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 16, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def _budgets(model: nn.Module) -> list[dict]:
    total = compute_module_sizes(model)[""]
    return [
        {0: total * 2, "cpu": total},
        {0: total // 3, "cpu": total},
        {0: total // 4, 1: total // 4, "cpu": total // 3},
        {0: total // 5, "cpu": total // 5},
        {"cpu": total // 2},
        {0: 0, "cpu": total},
    ]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("no_split", [None, ["Block"]])
def test_infer_auto_device_map_matches_accelerate(tied: bool, no_split: list[str] | None) -> None:
    model = Net(tied=tied)
    for budget in _budgets(model):
        ours = infer_auto_device_map(model, max_memory=dict(budget), no_split_module_classes=no_split)
        theirs = acc.infer_auto_device_map(model, max_memory=dict(budget), no_split_module_classes=no_split)
        buffers = {n for n, _ in model.named_buffers()}
        # The one difference (see sizes.py): a split module's own buffers are listed too.
        assert set(ours) - set(theirs) <= buffers, budget
        assert {k: v for k, v in ours.items() if k in theirs} == dict(theirs), budget
        raw = infer_auto_device_map(model, max_memory=dict(budget), no_split_module_classes=no_split,
                                    clean_result=False)  # fmt: skip
        names = {n for n, _ in model.named_parameters()}
        covered = {n for n in names if any(n == k or n.startswith(k + ".") for k in raw)}
        assert covered == names  # every parameter has a device


def test_balanced_memory_and_layer_size_match_accelerate() -> None:
    model = Net(depth=4)
    sizes = compute_module_sizes(model)
    for no_split in (None, ["Block"]):
        classes = no_split or []
        assert get_max_layer_size(list(model.named_children()), sizes, classes) == acc.get_max_layer_size(
            list(model.named_children()), acc.compute_module_sizes(model), classes
        )
        for budget in ({0: "10MB", 1: "10MB", "cpu": "1GB"}, {0: 4000, 1: 4000, 2: 9000, "cpu": 10**6}):
            for low_zero in (False, True):
                ours = get_balanced_memory(model, dict(budget), no_split, low_zero=low_zero)
                theirs = acc.get_balanced_memory(model, dict(budget), no_split, low_zero=low_zero)
                assert ours == theirs, (budget, no_split, low_zero)


def test_tied_parameters_found_and_retied_like_accelerate() -> None:
    model = Net(tied=True)
    model.blocks[2].attn.weight = model.blocks[0].attn.weight
    assert sorted(find_tied_parameters(model)) == sorted(acc.find_tied_parameters(model))
    ties = find_tied_parameters(model)
    model.head.weight = nn.Parameter(torch.zeros_like(model.head.weight))  # the link is broken
    retie_parameters(model, ties)
    assert model.head.weight is model.embed.weight


def test_set_module_tensor_to_device_matches_accelerate() -> None:
    ours, theirs = Net(), Net()
    value = torch.arange(64, dtype=torch.float64).reshape(8, 8)
    for net, fn in ((ours, set_module_tensor_to_device), (theirs, acc.set_module_tensor_to_device)):
        net.blocks[0].attn.weight.requires_grad_(False)
        fn(net, "blocks.0.attn.weight", "cpu", value=value)
        fn(net, "blocks.1.scale", "cpu", value=torch.full((8,), 3, dtype=torch.int64), dtype=torch.float16)
        fn(net, "norm.weight", "meta")
    for name in ("blocks.0.attn.weight", "blocks.1.scale"):
        a, b = (
            ours.get_parameter(name) if "weight" in name else ours.get_buffer(name),
            (theirs.get_parameter(name) if "weight" in name else theirs.get_buffer(name)),
        )
        assert type(a) is type(b) and a.dtype == b.dtype and a.requires_grad == b.requires_grad
        assert torch.equal(a, b)
    assert ours.norm.weight.is_meta and isinstance(ours.norm.weight, nn.Parameter)
    with pytest.raises(ValueError, match=re.escape("value of shape (3,) for 'norm.bias', which has shape (8,)")):
        set_module_tensor_to_device(ours, "norm.bias", "cpu", value=torch.zeros(3))
    with pytest.raises(ValueError, match=re.escape("'norm.weight' is on the meta device; pass value=")):
        set_module_tensor_to_device(ours, "norm.weight", "cpu")


def _saved(tmp_path: Path, model: nn.Module, safe: bool = True) -> Path:
    out = tmp_path / "weights"
    save_weights(model.state_dict(), out, safe_serialization=safe, max_shard_size=3000)
    return out


@pytest.mark.parametrize("safe", [True, False])
def test_load_checkpoint_in_model_reads_sharded_save_weights(tmp_path: Path, safe: bool) -> None:
    torch.manual_seed(0)
    source = Net(tied=True)
    out = _saved(tmp_path, source, safe)
    assert len(list(out.glob("*.safetensors" if safe else "*.bin"))) > 1  # really sharded
    target, reference = Net(tied=True), Net(tied=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every name of the checkpoint is one of the model's (tied ones too)
        load_checkpoint_in_model(target, out)
    acc.load_checkpoint_in_model(reference, str(out))
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor)
        assert torch.equal(reference.state_dict()[name], tensor)
    assert target.head.weight is target.embed.weight  # still tied


def test_load_checkpoint_in_model_places_and_offloads_by_device_map(tmp_path: Path) -> None:
    source = Net()
    out = _saved(tmp_path, source)
    with torch.device("meta"):
        target = Net()
    device_map = {"embed": "cpu", "blocks": "cpu", "norm": "disk", "head": "cpu"}
    load_checkpoint_in_model(target, out, device_map=device_map, offload_folder=tmp_path / "off", dtype=torch.float16)
    assert target.head.weight.dtype == torch.float16 and torch.equal(target.head.weight, source.head.weight.half())
    assert target.norm.weight.is_meta  # went to disk instead
    index = json.loads((tmp_path / "off" / "index.json").read_text())
    assert set(index) == {"norm.weight", "norm.bias"} and index["norm.weight"]["dtype"] == "float16"
    with pytest.raises(ValueError, match="device_map sends weights to 'disk'; pass offload_folder"):
        load_checkpoint_in_model(Net(), out, device_map=device_map)


def test_broken_checkpoints_fail_before_the_model_changes(tmp_path: Path) -> None:
    out = _saved(tmp_path, Net())
    target = Net()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    shards = sorted(out.glob("model-*.safetensors"))
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[: len(data) - 16])  # the last shard is truncated
    with pytest.raises(ValueError, match=re.escape(f"{shards[-1]} is not a readable safetensors file")):
        load_checkpoint_in_model(target, out)
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"lists shard(s) ['{shards[-1].name}'] that are not in")):
        load_checkpoint_in_model(target, out)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    (out / "extra.index.json").write_text("{}")
    with pytest.raises(ValueError, match=re.escape("expected one *.index.json or one of")):
        load_checkpoint_in_model(target, out)


def test_load_state_dict_and_shard_checkpoint(tmp_path: Path) -> None:
    model = Net()
    out = _saved(tmp_path, model)
    one = next(out.glob("model-00001-*.safetensors"))
    loaded = load_state_dict(one, device_map={"": "cpu"})
    assert loaded and all(torch.equal(t, model.state_dict()[n]) for n, t in loaded.items())
    shards, index = shard_checkpoint(model.state_dict(), max_shard_size=3000, weights_name="model.safetensors")
    written = json.loads((out / "model.safetensors.index.json").read_text())
    assert index == written  # the same split and names as the files save_weights wrote
    assert {n for part in shards.values() for n in part} == set(model.state_dict())
    assert shard_checkpoint(model.state_dict())[1] is None


def test_offload_folders_interoperate_with_accelerate(tmp_path: Path) -> None:
    state = {"a.weight": torch.randn(3, 4).bfloat16(), "b": torch.tensor(2.5), "c": torch.arange(6).reshape(2, 3)}
    offload_state_dict(tmp_path / "ours", state)
    index = json.loads((tmp_path / "ours" / "index.json").read_text())
    for name, info in index.items():
        theirs = acc.offload.load_offloaded_weight(str(tmp_path / "ours" / f"{name}.dat"), info)
        assert theirs.dtype == state[name].dtype and torch.equal(theirs, state[name])
    acc.offload_state_dict(str(tmp_path / "theirs"), {"weight": torch.randn(16, 8), "bias": torch.randn(16)})
    head = nn.Linear(8, 16)
    load_offloaded_weights(head, json.loads((tmp_path / "theirs" / "index.json").read_text()), tmp_path / "theirs")
    expected = acc.offload.load_offloaded_weight(str(tmp_path / "theirs" / "weight.dat"), {"dtype": "float32",
                                                                                         "shape": [16, 8]})  # fmt: skip
    assert torch.equal(head.weight, expected)


def test_offload_index_lists_only_complete_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "off"
    offload_state_dict(folder, {"first": torch.ones(4)})
    from fullshard.frontend.bigmodel import offload

    original, calls = offload.offload_weight, []

    def fail_on_second(weight, name, path, index=None):
        calls.append(name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return original(weight, name, path, index)

    monkeypatch.setattr(offload, "offload_weight", fail_on_second)
    with pytest.raises(OSError, match="No space left"):
        offload_state_dict(folder, {"second": torch.ones(2), "third": torch.ones(2)})
    assert set(json.loads((folder / "index.json").read_text())) == {"first"}
    (folder / "first.dat").write_bytes(b"\0" * 3)  # a truncated file is refused by name, and nothing is set
    model = nn.Module()
    model.register_buffer("first", torch.zeros(4))
    with pytest.raises(ValueError, match=re.escape("3 bytes on disk, but its index entry (float32, shape [4])")):
        load_offloaded_weights(model, {"first": {"dtype": "float32", "shape": [4]}}, folder)

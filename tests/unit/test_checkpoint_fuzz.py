"""Fuzz the read side of a real checkpoint: seeded random mutations of its ``.metadata``, markers, manifest,
small files and data file never load wrong values, never open a file outside the checkpoint, never unpickle
anything but plain values, and never hang.

One checkpoint is built once (a sharded model folder from ``save_sharded``, a scheduler and an RNG file
written as ``save_state`` writes them, and the manifest over all of them); each case mutates a copy and
reads it in this process the ways a load does: ``load_sharded``, ``merge_fsdp_weights``, ``verify`` and the
small-file path of ``load_state`` (``check_parts``, the boundary, ``check_file``, the safe unpickler).

Each case changes one file, as damage would, except three mutations that change two: a crafted ``.metadata``
also gets its CRC-32 recorded in the marker (as an attacker would write it), the double fault (a marker item
moved and a byte of that item flipped), and the consistent rewrite of a small file (new bytes, their CRC-32
recorded in the manifest). Damage to the data file together with the removal of every checksum (a folder saved
without them) cannot be told from a good folder and is not generated; nor is a ``.metadata`` and marker
rewritten consistently with each other to swap two same-shaped tensors (the tensors here all differ in shape, so
a swap is refused): ``docs/checkpoints.md``, "What checksums protect against".

Every case ends in one of exactly two classes, the same for every reader of the same scope ([Note: verify is a
load] in ``checkpoint/verify.py``): refused by all, or read by all, the values equal to the saved ones. The
scopes: the model folder (``load_sharded``, ``merge`` and ``verify`` of ``ck/pytorch_model_fsdp_0``) and the whole
checkpoint (``verify ck`` against what ``load_state`` reads: its small files and the model folder). "Loaded
different" fails the test, except for the consistent rewrite (``CONSISTENT_REWRITES``), which checksums do not
detect by design.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import shutil
import signal
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fullshard.checkpoint import load_sharded, merge_fsdp_weights, save_sharded
from fullshard.checkpoint.boundary import entry_path
from fullshard.checkpoint.checksum import save_with_checksum
from fullshard.checkpoint.manifest import CHECKPOINT_MANIFEST, FOLDER_MARKER, write_json_durably
from fullshard.checkpoint.names import DCP_METADATA_FILE
from fullshard.checkpoint.reader import read_metadata
from fullshard.checkpoint.safe_load import load_rng_file, load_small_file
from fullshard.checkpoint.verify import check_file, check_parts, verify_checkpoint

CASES = 300
CONSISTENT_REWRITES = {"rewrite"}  # the mutations that load other values by design (see the module docstring)
MODEL = "pytorch_model_fsdp_0"
SMALL = ("scheduler.bin", "random_states_0.pkl")
FILES = (
    f"{MODEL}/{DCP_METADATA_FILE}",
    f"{MODEL}/{FOLDER_MARKER}",
    f"{MODEL}/__0_0.distcp",
    CHECKPOINT_MANIFEST,
    *SMALL,
)
# Refusals: CheckpointDamagedError and CheckpointFileError are RuntimeErrors, NotACheckpointError a ValueError.
REFUSALS = (RuntimeError, ValueError, OSError)

# --- what must never happen, watched ------------------------------------------------------------------------------

_UNPICKLED: list[object] = []
_OPENED: list[str] | None = None


def _tripwire(*args: object) -> None:
    """What a crafted pickle calls; unpickling it appends here."""
    _UNPICKLED.append(args)


class _Evil:
    def __reduce__(self) -> tuple[Callable[..., None], tuple[str]]:
        return _tripwire, ("unpickled",)


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # cannot be removed; records only inside `_watch()`


class _Hang(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Hang


@contextlib.contextmanager
def _watch(seconds: int) -> Iterator[list[str]]:
    global _OPENED
    _OPENED = []
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(seconds)
    try:
        yield _OPENED
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        _OPENED = None


# --- the checkpoint, built once -------------------------------------------------------------------------------------


def _model() -> dict[str, Any]:
    # Every tensor a different shape: a swap of two entries is then refused (see the module docstring).
    return {"w": torch.arange(60, dtype=torch.float32).reshape(6, 10), "b": torch.linspace(0, 1, 7), "step": 3,
            "h": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)}  # fmt: skip


def _empty() -> dict[str, Any]:
    return {"w": torch.zeros(6, 10), "b": torch.zeros(7), "step": 0, "h": torch.zeros(3, 4, dtype=torch.bfloat16)}


SMALL_VALUES = {"scheduler.bin": {"last_epoch": 4, "lr": [0.1, 0.2]}, "random_states_0.pkl": {"seed": torch.arange(5)}}


def _build(root: Path) -> None:
    """A save_state-like folder: the model folder, two small files, and the manifest over them all."""
    save_sharded(_model(), root / MODEL)
    marker = json.loads((root / MODEL / FOLDER_MARKER).read_text())
    files = {f"{MODEL}/{name}": record for name, record in marker["files"].items()}
    marker_bytes = (root / MODEL / FOLDER_MARKER).read_bytes()
    files[f"{MODEL}/{FOLDER_MARKER}"] = {"size": len(marker_bytes), "crc32": zlib.crc32(marker_bytes)}
    for name, value in SMALL_VALUES.items():
        files[name] = save_with_checksum(value, root / name).to_json()
    for record in files.values():
        record.pop("items", None)
    manifest = {"format": "fullshard.save_state", "version": 1, "save_id": marker["save_id"], "world_size": 1,
                "files": files}  # fmt: skip
    write_json_durably(root / CHECKPOINT_MANIFEST, manifest)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    _build(root / "base")
    outside = root / "outside"
    outside.mkdir()
    other = save_sharded({**_model(), "w": torch.full((6, 10), 7.0)}, root / "other")
    shutil.copy(other / "__0_0.distcp", outside / "x.distcp")  # what a crafted entry would read instead
    (outside / "secret.bin").write_bytes(pickle.dumps(_Evil()))
    return root


# --- mutations ------------------------------------------------------------------------------------------------------


def _targets(root: Path) -> list[str]:
    """Paths a crafted entry might name: out of the folder, absolute, into the pristine copy, a system file."""
    # A case is root/cases/<seed>/ckpt/pytorch_model_fsdp_0: four levels up is root.
    return ["../x.distcp", "../../../../outside/x.distcp", "../../../../base/pytorch_model_fsdp_0/__0_0.distcp",
            str(root / "outside" / "x.distcp"), str(root / "base" / MODEL / "__0_0.distcp"), "/etc/passwd",
            "missing.distcp", "", ".", "a/../__0_0.distcp", "../../../outside/secret.bin", "__0_0.distcp/"]  # fmt: skip


def _record_crc(case: Path, name: str, marker_too: bool) -> None:
    """Record the current bytes of ``name`` in the manifest (and the model folder's marker), as a crafter would."""
    data = (case / name).read_bytes()
    holders = [(case / CHECKPOINT_MANIFEST, name)]
    if marker_too and name.startswith(f"{MODEL}/"):
        holders.append((case / MODEL / FOLDER_MARKER, name.split("/", 1)[1]))
    for holder, key in reversed(holders):  # the marker first: the manifest records the marker's bytes too
        payload = json.loads(holder.read_text())
        payload["files"][key].update(size=len(data), crc32=zlib.crc32(data))
        holder.write_text(json.dumps(payload))
    if len(holders) > 1:
        _record_crc(case, f"{MODEL}/{FOLDER_MARKER}", marker_too=False)


def _flip(rng: random.Random, case: Path, name: str) -> None:
    data = bytearray((case / name).read_bytes())
    for _ in range(rng.randint(1, 3)):
        if data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    (case / name).write_bytes(bytes(data))


def _truncate(rng: random.Random, case: Path, name: str) -> None:
    data = (case / name).read_bytes()
    (case / name).write_bytes(data[: rng.randrange(len(data))])


def _random_value(rng: random.Random, root: Path) -> object:
    return rng.choice([-1, 0, 1, 2**62, "x", None, [], {}, [[0, 1, 2]], 3.5, *_targets(root)])


def _edit_json(rng: random.Random, node: Any, root: Path, depth: int = 0) -> Any:
    """``node`` with one random change somewhere in it: a value replaced, a key dropped or renamed."""
    children = list(node.items()) if isinstance(node, dict) else list(enumerate(node)) if isinstance(node, list) else []
    if not children or (depth and rng.random() < 0.3):
        return _random_value(rng, root)
    key, child = rng.choice(children)
    action = rng.random()
    if isinstance(node, dict) and action < 0.15:
        del node[key]
    elif isinstance(node, dict) and action < 0.3:
        node[rng.choice(_targets(root))] = node.pop(key)
    else:
        node[key] = _edit_json(rng, child, root, depth + 1)
    return node


def _mutate_json(rng: random.Random, case: Path, name: str, root: Path) -> None:
    payload = json.loads((case / name).read_text())
    (case / name).write_text(json.dumps(_edit_json(rng, payload, root)))


def _craft_metadata(rng: random.Random, case: Path, root: Path) -> None:
    metadata = read_metadata(case / MODEL)
    entries = list(metadata.storage_data.items())
    index, info = rng.choice(entries)
    choice = rng.randrange(6)
    if choice == 0:
        object.__setattr__(info, "relative_path", rng.choice(_targets(root)))
    elif choice == 1:
        object.__setattr__(info, "offset", max(0, info.offset + rng.choice([-1, 1]) * rng.randint(1, 400)))
    elif choice == 2:
        object.__setattr__(info, "length", max(0, info.length + rng.choice([-1, 1]) * rng.randint(1, 400)))
    elif choice == 3:  # two entries swap where their bytes are
        other_index, other = rng.choice(entries)
        metadata.storage_data[index], metadata.storage_data[other_index] = other, info
    elif choice == 4:
        object.__setattr__(info, rng.choice(["offset", "length", "relative_path"]), rng.choice([-7, 2**70, None]))
    else:
        tensor_md = metadata.state_dict_metadata[index.fqn]
        if hasattr(tensor_md, "size"):
            object.__setattr__(tensor_md, "size", torch.Size([rng.randint(1, 9) for _ in tensor_md.size]))
    (case / MODEL / DCP_METADATA_FILE).write_bytes(pickle.dumps(metadata))
    if rng.random() < 0.8:
        _record_crc(case, f"{MODEL}/{DCP_METADATA_FILE}", marker_too=True)


def _symlink(rng: random.Random, case: Path, name: str, root: Path) -> None:
    """Replace ``name`` by a link: to an identical copy outside (right values, wrong place), or to a sentinel."""
    target = root / "outside" / f"copy-{name.replace('/', '_')}"
    shutil.copy(case / name, target)
    target = rng.choice([target, root / "outside" / "secret.bin", root / "outside" / "x.distcp"])
    (case / name).unlink()
    (case / name).symlink_to(target)


def _evil_pickle(rng: random.Random, case: Path, name: str) -> None:
    (case / name).write_bytes(pickle.dumps(_Evil()) if rng.random() < 0.5 else pickle.dumps({"x": _Evil()}))
    if rng.random() < 0.7:
        _record_crc(case, name, marker_too=True)


def _double_fault(rng: random.Random, case: Path) -> None:
    """One marker item moved (or resized) and a byte of that item flipped."""
    marker_path = case / MODEL / FOLDER_MARKER
    marker = json.loads(marker_path.read_text())
    items = marker["files"]["__0_0.distcp"]["items"]
    item = rng.choice(items)
    offset, length = item[0], item[1]
    item[rng.randrange(2)] += rng.choice([-1, 1]) * rng.randint(1, 64)
    marker_path.write_text(json.dumps(marker))
    data = bytearray((case / MODEL / "__0_0.distcp").read_bytes())
    data[offset + rng.randrange(length)] ^= 1 << rng.randrange(8)
    (case / MODEL / "__0_0.distcp").write_bytes(bytes(data))


def _mutate(rng: random.Random, case: Path, root: Path) -> str:
    name = rng.choice(FILES)
    kinds = ["flip", "flip", "truncate", "json", "craft", "craft", "link", "pickle", "double", "delete", "rewrite"]
    kind = rng.choice(kinds)
    if kind == "rewrite" and name in SMALL:  # other plain values, their CRC-32 recorded: a consistent rewrite
        (case / name).unlink()
        save_with_checksum({"last_epoch": 9} if name == "scheduler.bin" else {"seed": torch.ones(5)}, case / name)
        _record_crc(case, name, marker_too=False)
    elif kind == "json" and name.endswith(".json"):
        _mutate_json(rng, case, name, root)
    elif kind == "craft" or (kind == "json" and name.endswith(DCP_METADATA_FILE)):
        kind = "craft"
        _craft_metadata(rng, case, root)
    elif kind == "link":
        _symlink(rng, case, name, root)
    elif kind == "pickle" and not name.endswith((".json", ".distcp")):
        _evil_pickle(rng, case, name)
    elif kind == "double":
        _double_fault(rng, case)
    elif kind == "delete":
        (case / name).unlink()
    elif kind == "truncate":
        _truncate(rng, case, name)
    else:
        kind = "flip"
        _flip(rng, case, name)
    return f"{kind} {name}"


# --- reading a case the ways a load does ----------------------------------------------------------------------------


def _equal(got: dict[str, torch.Tensor], want: dict[str, Any]) -> bool:
    return all(torch.equal(got[k], want[k]) for k in ("w", "b", "h"))


def _read_sharded(case: Path) -> bool:
    loaded = _empty()
    load_sharded(loaded, case / MODEL)
    return _equal(loaded, _model()) and loaded["step"] == 3


def _read_merged(case: Path) -> bool:
    out = case.parent / "merged"
    shutil.rmtree(out, ignore_errors=True)
    merge_fsdp_weights(str(case / MODEL), str(out), show_progress=False)
    return _equal(load_file(str(out / "model.safetensors")), _model())


def _read_small(case: Path) -> bool:
    """What load_state does with its small files on one rank: parts, boundary, checksum, safe unpickling."""
    manifest = check_parts(case)
    same = True
    for name, value in SMALL_VALUES.items():
        path = entry_path(case, name)
        check_file(path, manifest)
        loaded = (load_rng_file if name.startswith("random_states") else load_small_file)(path)
        same = same and repr(loaded) == repr(value)
    return same


def _verify(folder: Path) -> bool:
    verify_checkpoint(folder)
    return True  # verify reads no values out: "read" stands for whatever the loads read


READS: dict[str, Callable[[Path], bool]] = {
    "load_sharded": _read_sharded,
    "merge": _read_merged,
    "verify ck/model": lambda case: _verify(case / MODEL),
    "load_state small files": _read_small,
    "verify ck": _verify,
}


def _classes(got: dict[str, str]) -> tuple[str, str]:
    """(the model folder's outcome, the whole checkpoint's): "refused", "equal", "different" or "disagree"."""
    part = {got["load_sharded"], got["merge"], got["verify ck/model"].replace("read", "equal")}
    part_class = part.pop() if len(part) == 1 else "disagree"
    loads = [got["load_state small files"], got["load_sharded"]]
    load_state = "refused" if "refused" in loads else "different" if "different" in loads else "equal"
    verified = got["verify ck"]
    whole_class = load_state if (verified == "refused") == (load_state == "refused") else "disagree"
    return part_class, whole_class


def test_random_mutations_are_refused_by_every_reader_or_load_equal(world: Path) -> None:
    base, cases = world / "base", world / "cases"
    for read in READS.values():  # the pristine checkpoint reads, every way
        assert read(base), "the pristine checkpoint read other values"
    classes: dict[str, int] = {}
    for seed in range(CASES):
        rng = random.Random(seed)
        case = cases / str(seed) / "ckpt"
        shutil.copytree(base, case, symlinks=True)
        what = _mutate(rng, case, world)
        got: dict[str, str] = {}
        for how, read in READS.items():
            with _watch(seconds=20) as opened:
                try:
                    got[how] = "equal" if read(case) else "different"
                except REFUSALS:
                    got[how] = "refused"
                except _Hang:
                    pytest.fail(f"case {seed} ({what}): {how} hung")
            stray = [p for p in opened if not p.startswith(str(case.parent.resolve()) + os.sep)]
            stray = [p for p in stray if p.startswith(str(world.resolve())) or p.startswith("/etc/")]
            assert not stray, f"case {seed} ({what}): {how} opened {stray} outside the checkpoint"
            assert not _UNPICKLED, f"case {seed} ({what}): {how} unpickled a crafted object"
        part, whole = _classes(got)
        rewrite = what.split()[0] in CONSISTENT_REWRITES
        assert part in ("refused", "equal"), f"case {seed} ({what}): the model folder's readers: {got}"
        assert whole in ("refused", "equal") or (whole == "different" and rewrite), f"case {seed} ({what}): {got}"
        key = f"{part}/{whole}" + (" (consistent rewrite)" if rewrite and whole == "different" else "")
        classes[key] = classes.get(key, 0) + 1
        shutil.rmtree(case.parent)
    print(classes)
    assert classes.get("equal/equal", 0) > 0, classes  # harmless mutations (an unused JSON key) still load
    assert classes.get("equal/refused", 0) > CASES // 10, classes  # damage outside the model folder spares it
    assert classes.get("refused/refused", 0) > CASES // 4, classes  # and most damage is refused by every reader

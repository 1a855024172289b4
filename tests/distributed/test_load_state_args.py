"""``Accelerator.load_state(strict=...)`` and the keywords ``save_state``/``load_state`` refuse by name.

Set up: a TinyGPT with an extra head (``aux``) saved on 2 ranks, sharded and full state dicts.
Run: load into the plain TinyGPT (which lacks ``aux``), strictly and with ``strict=False``.
Check: strict refuses naming the extra key and leaves the model as it was; ``strict=False`` loads every key the
model has, bitwise; keywords Accelerate passes on to DeepSpeed are refused by name, never swallowed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fullshard import Accelerator
from fullshard.testing import WorkerPool
from fullshard.testing.models import TinyGPT
from tests.distributed.test_accelerator import CFG, plugin


class WithAux(TinyGPT):
    def __init__(self) -> None:
        super().__init__(CFG)
        self.aux = nn.Linear(CFG.n_embd, 3)


def load_with_and_without_strict(rank: int, world: int, folder: str, state_dict_type: str) -> tuple[str, bool, bool]:
    torch.manual_seed(0)
    saver = Accelerator(fsdp_plugin=plugin(2, state_dict_type=state_dict_type))
    saved = saver.prepare(WithAux())
    saver.save_state(folder)
    want = {k: v for k, v in saver.get_state_dict(saved).items() if not k.startswith("aux.")}
    torch.manual_seed(1)  # other initial values, so a load that did nothing shows
    loader = Accelerator(fsdp_plugin=plugin(2, state_dict_type=state_dict_type))
    model = loader.prepare(TinyGPT(CFG))
    before = loader.get_state_dict(model)
    try:
        loader.load_state(folder)
        error = ""
    except ValueError as exc:
        error = str(exc)
    unchanged = all(torch.equal(v, before[k]) for k, v in loader.get_state_dict(model).items())
    loader.load_state(folder, strict=False)
    loaded = all(torch.equal(v, want[k]) for k, v in loader.get_state_dict(model).items())
    return error, unchanged, loaded


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_strict_false_ignores_keys_the_model_lacks(pool2: WorkerPool, tmp_path: Path, state_dict_type: str) -> None:
    results = pool2.run(load_with_and_without_strict, str(tmp_path / "ckpt"), state_dict_type)
    error, unchanged, loaded = results[0]  # rank 0 holds the full state dicts
    assert "aux.weight" in error and "strict=False" in error, error
    assert unchanged and loaded
    assert all(r[0] for r in results), "every rank refuses the strict load"


def refused_keywords(rank: int, world: int, folder: str) -> list[str]:
    accelerator = Accelerator(fsdp_plugin=plugin(2))
    accelerator.prepare(TinyGPT(CFG))
    messages = []
    for call in (lambda: accelerator.save_state(folder, tag="x"),
                 lambda: accelerator.load_state(folder, load_kwargs={"weights_only": False}),
                 lambda: accelerator.load_state(folder, map_location="cuda:3")):  # fmt: skip
        try:
            call()
            messages.append("")
        except (TypeError, ValueError) as exc:
            messages.append(str(exc))
    return messages


def test_save_and_load_state_refuse_unknown_keywords_by_name(pool2: WorkerPool, tmp_path: Path) -> None:
    save, load, location = pool2.run(refused_keywords, str(tmp_path / "ckpt"))[0]
    assert save.startswith("Accelerator.save_state(tag=...)") and "DeepSpeed" in save
    assert load.startswith("Accelerator.load_state(weights_only=...)")
    assert "map_location='cuda:3'" in location
    assert not (tmp_path / "ckpt").exists(), "a refused save writes nothing"

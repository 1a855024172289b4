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


def load_into_own_state(rank: int, world: int, folder: str, version: int) -> tuple[bool, bool, bool]:
    """Train a step, save, scribble over the optimizer state, load: (values back, same storage, step back)."""
    from fullshard.testing.models import make_batch

    torch.manual_seed(0)
    accelerator = Accelerator(fsdp_plugin=plugin(version))
    model = accelerator.prepare(TinyGPT(CFG))
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = make_batch(CFG, 2, seed=rank)
    accelerator.backward(model(x, y))
    optimizer.step()
    optimizer.zero_grad()
    accelerator.save_state(folder)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    states = [s for s in optimizer.optimizer.state.values()]
    saved = [{k: local(v).clone() for k, v in s.items()} for s in states]
    pointers = [{k: local(v).data_ptr() for k, v in s.items() if local(v).dim() > 0} for s in states]
    for s in states:
        for value in s.values():
            local(value).add_(1.0)  # a load that did nothing shows
    accelerator.load_state(folder)
    after = list(optimizer.optimizer.state.values())
    equal = all(torch.equal(local(s[k]), v) for s, want in zip(after, saved) for k, v in want.items())
    same = all(local(s[k]).data_ptr() == ptr for s, want in zip(after, pointers) for k, ptr in want.items())
    steps = all(float(local(s["step"])) == 1.0 for s in after)
    return equal, same, steps


@pytest.mark.parametrize("version", [1, 2])
def test_load_state_fills_the_optimizer_state_without_a_copy(pool2: WorkerPool, tmp_path: Path, version: int) -> None:
    """The 840M FSDP-class load ran out of memory copying every loaded Adam state (docs/benchmarks.md): DCP
    loads into the optimizer's own tensors, and those are handed over as they are, so no second copy is made."""
    for equal, same, steps in pool2.run(load_into_own_state, str(tmp_path / "ckpt"), version):
        assert equal and steps, "load_state restores the saved optimizer state"
        assert same, "the optimizer keeps its own tensors: the loaded values land in place, no copy"

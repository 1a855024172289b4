"""World-size-invariant mode through the Accelerator, resumed on another world size (issue 27 §2): a checkpoint
``save_state`` wrote on 2 ranks in the middle of an epoch resumes with ``load_state`` on 1, 2 and 4 ranks, and the
continued run ends with ``torch.equal`` weights to the uninterrupted 2-rank run's; see [Note: invariant training
through the Accelerator] in ``frontend/invariant.py`` and [Note: loader position] in
``frontend/data/sharded_loader.py``.

Set up: ``test_invariant_accelerator``'s loop (DropNet with dropout, AdamW, StepLR, clipping, a shuffled loader whose
last global batch is completed from the epoch's start), with ``invariant_micro_batches=4``, ``SHARDED_STATE_DICT``
and ``use_stateful_dataloader=True``; ``fsdp_version`` 1 and 2. The 2-rank run saves mid-epoch at a step boundary (after
2 steps, the padded last global batch next; or after 4, one step into the second epoch) and goes on to the end of 2
epochs: the uninterrupted run (equal to a run that never saved).
Run: a fresh Accelerator (other seed, other initial weights) on 1, 2 and 4 ranks ``load_state``s it and trains on
from where the loader stands to the end of the second epoch.
Check: the final weights and the clipping norms after the resume are the uninterrupted run's, bitwise; no
world-size warning (the default mode's one line is checked in ``test_resume_world_size``).

Mid-step: saved on 2 ranks one micro-batch into a step (between two ``accumulate()`` blocks), the checkpoint holds
each rank's partial gradient sums (``step_in_progress_<rank>.pt``): it resumes bitwise on 2 ranks and is refused on
1 and 4 (another ``G/N``) before anything is loaded, naming the micro-batches and the fix. A save inside
``accumulate()`` before its ``backward`` is refused (the count and the sums would disagree).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from fullshard import Accelerator, DataLoaderConfiguration
from fullshard.engine import invariant_micro_batches, invariant_per_rank, pending_micro_batches
from fullshard.testing import RankFailure, WorkerPool
from fullshard.utils import set_seed
from tests.distributed.test_invariant_accelerator import EPOCHS, MAX_NORM, MICRO, DropNet, _dataset, _plugin

G, SAVE_AT = 4, 4  # 3 steps an epoch: by default the checkpoint is one step into the second epoch


def _prepared(version: int, seed: int) -> tuple[Any, ...]:
    plugin = _plugin(version, "FULL_SHARD", G, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(
        fsdp_plugin=plugin, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    set_seed(seed)
    model = DropNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = DataLoader(_dataset(), batch_size=MICRO, shuffle=True)
    return accelerator, *accelerator.prepare(model, optimizer, loader, scheduler)


def train(rank: int, world: int, version: int, root: str, mode: str, save_at: int = SAVE_AT) -> dict[str, Any]:
    """``mode``: "straight" (2 epochs), "save" (the same, saving to ``root`` after ``save_at`` steps), "save
    mid-step" (saving one micro-batch into the next step instead; 2 micro-batches a step on 2 ranks), "save before
    backward" (refused) or "resume" (``load_state(root)``, then on to the end of the second epoch). Returns rank 0's
    full weights, the norms from step ``save_at`` on, the warnings ``load_state`` gave, and what the engine's
    surface says of the model after the run's first backward: ``G``, ``G/N`` and the micro-batches pending."""
    accelerator, model, optimizer, loader, scheduler = _prepared(version, seed=5 if mode == "resume" else 0)
    caught: list[Any] = []
    steps = 0
    if mode == "resume":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accelerator.load_state(root)
        steps = save_at
    norms, surface = [], None
    for _ in range(loader.iteration, EPOCHS):
        for x, y, _index in loader:
            with accelerator.accumulate(model):
                if mode == "save before backward" and steps == save_at:
                    accelerator.save_state(root)  # refused: accumulate() counted a micro-batch not folded yet
                accelerator.backward(model(x, y))
                if surface is None:
                    surface = (invariant_micro_batches(model), invariant_per_rank(model), pending_micro_batches(model))
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                    if steps >= save_at:
                        norms.append(norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                steps += 1
                if mode == "save" and steps == save_at:
                    accelerator.save_state(root)
            elif mode == "save mid-step" and steps == save_at:  # one micro-batch into the step after save_at
                accelerator.save_state(root)
    return {
        "params": accelerator.get_state_dict(model),
        "norms": norms,
        "steps": steps,
        "lr": scheduler.get_last_lr()[0],
        "warnings": [str(w.message) for w in caught],
        "surface": surface,
    }


def _assert_same_run(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got["steps"] == want["steps"] and got["lr"] == want["lr"], what
    assert got["params"].keys() == want["params"].keys(), what
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), f"{what}: {name} differs"
    assert len(got["norms"]) == len(want["norms"]) > 0, what
    for a, b in zip(got["norms"], want["norms"], strict=True):
        assert torch.equal(a, b), f"{what}: norm {a} != {b}"


@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
@pytest.mark.parametrize("save_at", [2, SAVE_AT], ids=["epoch0-step2", "epoch1-step1"])  # 2: the padded batch next
def test_saved_on_2_ranks_mid_epoch_resumes_bitwise_on_1_2_4(
    tmp_path: Path, pool1: WorkerPool, pool2: WorkerPool, pool4: WorkerPool, version: int, save_at: int
) -> None:
    # - Set up: the 2-rank run that saves after save_at steps and goes on, and one that never saves
    root = str(tmp_path / "ckpt")
    want = pool2.run(train, version, root, "save", save_at)[0]
    assert want["steps"] == EPOCHS * 3 and float(want["norms"][0]) > MAX_NORM  # clipping was active
    _assert_same_run(pool2.run(train, version, "", "straight", save_at)[0], want, "a run that never saved")
    # - Run and Check: resume on 1, 2 and 4 ranks
    for world, pool in ((1, pool1), (2, pool2), (4, pool4)):
        got = pool.run(train, version, root, "resume", save_at)
        _assert_same_run(got[0], want, f"fsdp{version}: saved after {save_at} steps, resumed on {world} ranks")
        # G, G/N, and one micro-batch folded after the first backward (none left when G/N = 1: reduced at once)
        assert got[0]["surface"] == (G, G // world, 0 if G // world == 1 else 1), got[0]["surface"]
        assert all(not r["warnings"] for r in got), [r["warnings"] for r in got]


@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
def test_saved_mid_step_resumes_bitwise_on_the_same_world_size_only(
    tmp_path: Path, pool1: WorkerPool, pool2: WorkerPool, pool4: WorkerPool, version: int
) -> None:
    # - Set up: the 2-rank run that saves one micro-batch into step SAVE_AT + 1 and goes on
    root = str(tmp_path / "ckpt")
    want = pool2.run(train, version, root, "save mid-step")[0]
    assert sorted(p.name for p in Path(root).glob("step_in_progress_*")) == [
        "step_in_progress_0.pt",
        "step_in_progress_1.pt",
    ]
    # - Run and Check: bitwise on 2 ranks; refused on 1 and 4, before anything is loaded
    _assert_same_run(pool2.run(train, version, root, "resume")[0], want, f"fsdp{version}: mid-step, 2 ranks")
    for world, pool in ((1, pool1), (4, pool4)):
        with pytest.raises(RankFailure) as refused:
            pool.run(train, version, root, "resume")
        message = str(refused.value)
        assert "saved 1 micro-batches into a step of 2 per rank, on 2 processes" in message, message
        assert f"resumes only on 2 processes, not {world}" in message
        assert "save the state after optimizer.step()" in message


def test_a_save_between_accumulate_and_backward_is_refused(tmp_path: Path, pool2: WorkerPool) -> None:
    with pytest.raises(RankFailure, match=r"accumulate\(\) counted 1 micro-batches of this step but 0 went through"):
        pool2.run(train, 2, str(tmp_path / "ckpt"), "save before backward")
    assert not (tmp_path / "ckpt").exists()

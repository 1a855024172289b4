"""World-size-invariant mode's front end, single-process parts: the plugin's ``invariant_micro_batches`` and its
variables, the dealing of micro-batches (the same micro-batch ``g`` on every world size), the padding rows
``gather_for_metrics`` drops, and a loader position carried to another world size; see
[Note: invariant training through the Accelerator] in ``frontend/invariant.py``."""

from __future__ import annotations

import re

import pytest
from torch import nn

from fullshard import FullyShardedDataParallelPlugin as Plugin
from fullshard.engine import (
    has_units,
    invariant_micro_batches,
    invariant_per_rank,
    is_unit,
    micro_batches_per_rank,
    pending_micro_batches,
    step_in_progress,
)
from fullshard.frontend import env, invariant
from fullshard.frontend.data.sharded_loader import ShardBatchSampler


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FSDP_INVARIANT_MICRO_BATCHES", "FULLSHARD_INVARIANT_MICRO_BATCHES", "FSDP_VERSION"):
        monkeypatch.delenv(name, raising=False)


# --- the names -----------------------------------------------------------------------------------------------


def test_plugin_field_reaches_both_entry_points() -> None:
    assert Plugin().invariant_micro_batches is None
    assert "invariant_micro_batches" not in Plugin().fsdp_kwargs()  # the default mode passes nothing new
    assert Plugin(invariant_micro_batches=8).fsdp_kwargs()["invariant_micro_batches"] == 8
    assert Plugin(fsdp_version=2, invariant_micro_batches="4").fully_shard_kwargs()["invariant_micro_batches"] == 4
    assert Plugin(invariant_micro_batches=0).invariant_micro_batches is None


def test_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_INVARIANT_MICRO_BATCHES", "8")
    assert Plugin().invariant_micro_batches == 8
    assert Plugin(invariant_micro_batches=4).invariant_micro_batches == 4  # the argument wins
    assert Plugin().to_env()["FSDP_INVARIANT_MICRO_BATCHES"] == "8"
    monkeypatch.delenv("FSDP_INVARIANT_MICRO_BATCHES")
    monkeypatch.setenv("FULLSHARD_INVARIANT_MICRO_BATCHES", "16")  # the engine's variable, read when the other is unset
    assert Plugin().invariant_micro_batches == 16
    assert env.by_field("invariant_micro_batches").flag == "--fsdp_invariant_micro_batches"


@pytest.mark.parametrize(
    "kwargs, variables, message",
    [
        ({"invariant_micro_batches": 6}, {}, "invariant_micro_batches=6: world-size-invariant mode needs"),
        (
            {},
            {"FSDP_INVARIANT_MICRO_BATCHES": "12"},
            "environment variable FSDP_INVARIANT_MICRO_BATCHES=12: world-size",
        ),
        ({}, {"FSDP_INVARIANT_MICRO_BATCHES": "-2"}, "FSDP_INVARIANT_MICRO_BATCHES='-2': the number of micro-batches"),
        (
            {},
            {"FSDP_INVARIANT_MICRO_BATCHES": "8", "FULLSHARD_INVARIANT_MICRO_BATCHES": "4"},
            "FSDP_INVARIANT_MICRO_BATCHES=8 and FULLSHARD_INVARIANT_MICRO_BATCHES='4' disagree",
        ),
        (
            {"invariant_micro_batches": 0},
            {"FULLSHARD_INVARIANT_MICRO_BATCHES": "4"},
            "invariant_micro_batches=0 and FULLSHARD_INVARIANT_MICRO_BATCHES='4' disagree",
        ),
    ],
)
def test_refusals(monkeypatch: pytest.MonkeyPatch, kwargs: dict, variables: dict, message: str) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        Plugin(**kwargs)


def test_accelerator_configuration() -> None:
    assert invariant.configure(None, 2, 5) is None
    assert invariant.configure(8, 2, 1).per_rank == 4
    assert invariant.configure(8, 2, 4).per_rank == 4
    with pytest.raises(ValueError, match="invariant_micro_batches=2 is not a multiple of the data-parallel size 4"):
        invariant.configure(2, 4, 1)
    with pytest.raises(ValueError, match=r"sets gradient_accumulation_steps to that itself"):
        invariant.configure(8, 2, 8)


# --- dealing -------------------------------------------------------------------------------------------------

G, MICRO, SAMPLES = 8, 2, 37  # 16 samples per global batch: 3 of them, the last with 5 real samples


def _dealers(world: int) -> list[ShardBatchSampler]:
    return [
        ShardBatchSampler(
            list(range(SAMPLES)), MICRO, world, rank, drop_last=False, even_batches=True, per_rank=G // world
        )
        for rank in range(world)
    ]


def test_micro_batch_g_is_the_same_on_every_world_size() -> None:
    dealt = {}
    for world in (1, 2, 4, 8):
        by_index = {}
        for dealer in _dealers(world):
            batches = list(dealer)
            assert len(batches) == len(dealer) == 3 * G // world
            for position, batch in enumerate(batches):
                by_index[dealer.micro_batch_index(position)] = batch
                # rank i runs micro-batches i*G/N .. (i+1)*G/N - 1 of each global batch, in order
                assert dealer.micro_batch_index(position) % G // (G // world) == dealer.rank
        dealt[world] = by_index
    assert dealt[1] == dealt[2] == dealt[4] == dealt[8]
    assert dealt[1][0] == [0, 1] and dealt[1][23] == [9, 10]  # the padding comes from the epoch's start


def test_metric_rows_keep_each_real_sample_once() -> None:
    for world in (1, 2, 4):
        kept = []
        for position in range(3 * G // world):
            dealers = _dealers(world)
            for d in dealers:
                list(d)  # draws the order: sets the remainder
            rows = dealers[0].metric_rows(position)
            batches = [list(d)[position] for d in dealers]
            gathered = [i for b in batches for i in b]
            kept += gathered if rows is None else invariant.keep_rows(gathered, rows, objects=True)
        assert sorted(kept) == list(range(SAMPLES)), world


def test_position_moves_to_another_world_size() -> None:
    two, four = _dealers(2)[0], _dealers(4)[0]
    two.in_progress, two.position = True, 8  # two steps of 4 micro-batches per rank
    state = two.state_dict()
    assert state["per_rank"] == 4 and "micro_batch_seed" in state
    assert state["samples"] == 2 * four.step_samples and state["micro_batches_into_step"] == 0
    four.load_state_dict(state, restore_position=True)
    assert four.pending == (2 * four.step_samples, 0)  # two global batches: two steps of 2 micro-batches per rank
    four.begin_epoch(0)
    assert four.position == 0 and four.micro_batch_index(0) == 2 * G + 0  # rank 0's first of the third step
    assert list(four) == list(_dealers(4)[0])[4:]  # the uninterrupted 4-rank epoch from its third step
    two.position = 6
    with pytest.raises(ValueError, match="2 micro-batches into a step of 4 per rank"):
        four.load_state_dict(two.state_dict(), restore_position=True)


# --- G/N, once; the loss division backward applies --------------------------------------------------------------


def test_micro_batches_per_rank_is_the_one_division() -> None:
    assert [micro_batches_per_rank(8, n) for n in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert invariant.configure(8, 4, 1).per_rank == micro_batches_per_rank(8, 4)
    with pytest.raises(
        ValueError, match=re.escape("invariant_micro_batches=6 is not a multiple of the data-parallel size 4")
    ):
        micro_batches_per_rank(6, 4)


def test_loss_divisor() -> None:
    # - Set up: G = 8 on 2 ranks (G/N = 4), created with gradient_accumulation_steps=1; a loop announcing its steps
    run = invariant.configure(8, 2, 1)
    caller = invariant.CallerSteps(run)
    # - Check: the default mode and accumulate() divide by the steps; a loop that accumulates itself by what the
    #   Accelerator was created with; any other backward outside accumulate() is refused while G/N > 1
    assert invariant.loss_divisor(None, 3, accumulating=False, caller=None) == 3
    assert invariant.loss_divisor(run, 4, accumulating=True, caller=caller) == 4
    caller.active = True
    assert invariant.loss_divisor(run, 4, accumulating=False, caller=caller) == 1
    caller.active = False
    with pytest.raises(
        RuntimeError, match=re.escape("Accelerator.backward outside accumulate() in world-size-invariant")
    ):
        invariant.loss_divisor(run, 4, accumulating=False, caller=caller)
    assert invariant.loss_divisor(invariant.configure(2, 2, 1), 1, accumulating=False, caller=None) == 1  # G/N = 1


def test_engine_surface_on_a_model_never_sharded() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    assert not is_unit(model) and not has_units(model) and not invariant.invariant_mode(model)
    assert (invariant_micro_batches(model), invariant_per_rank(model)) == (None, None)
    assert pending_micro_batches(model) == 0 and step_in_progress(model) is None
    assert invariant.step_to_save([model]) is None

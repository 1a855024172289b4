"""Muon's whole-parameter step pipelined slot by slot (see [Note: pipelined whole steps]): from the second step
(when every rank knows the state's layout) the gathers run in the background while each owner steps its matrices
one at a time as they arrive, and each matrix's scatter starts as soon as it is stepped; the weights and states
stay ``torch.equal`` to the unsharded Muon's."""

from __future__ import annotations

from unittest import mock

import pytest

from fullshard.algorithms import whole_step
from fullshard.testing import WorkerPool
from tests.distributed.test_whole_step import STEPS, train


def pipelined(rank: int, world: int, entry: str) -> tuple[list[str], int]:
    """What differs from the unsharded run, and how many steps took the pipelined path."""
    calls = []
    real = whole_step.WholeParamStep._pipeline

    def counted(self: whole_step.WholeParamStep, bucket: object) -> None:
        calls.append(bucket)
        real(self, bucket)

    with mock.patch.object(whole_step.WholeParamStep, "_pipeline", counted):
        differ = train(rank, world, "muon", entry)
    return differ, len(calls)


@pytest.mark.parametrize("entry", ["fully_shard", "fsdp-orig"])
def test_muon_steps_pipelined_and_bitwise(pool2: WorkerPool, entry: str) -> None:
    for rank, (differ, steps) in enumerate(pool2.run(pipelined, entry)):
        assert differ == [], f"{entry}, rank {rank}: {differ}"
        assert steps == STEPS - 1, f"{entry}, rank {rank}: {steps} pipelined steps of {STEPS}"

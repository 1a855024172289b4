"""Muon's whole-parameter step from the second step on (when every rank knows the state's layout): split at
Newton-Schulz (see [Note: split Muon steps]: the element-wise parts on each rank's rows, only Newton-Schulz's bf16
input and output exchanged), or, for a Muon whose state holds more than its momentum, pipelined slot by slot with
whole tensors (see [Note: pipelined whole steps]); either way the weights and states stay ``torch.equal`` to the
unsharded Muon's."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fullshard import fully_shard
from fullshard.algorithms import whole_step
from fullshard.algorithms.whole_step import whole_param_step
from fullshard.testing import WorkerPool
from tests.distributed.test_whole_step import MLP, STEPS, train


def pipelined(rank: int, world: int, entry: str, split: bool) -> tuple[list[str], int, int]:
    """What differs from the unsharded run, how many steps took the pipelined path, and how many of them split."""
    calls: list[object] = []
    splits: list[object] = []
    real, real_split = whole_step.WholeParamStep._pipeline, whole_step.WholeParamStep._split_step

    def counted(self: whole_step.WholeParamStep, bucket: object) -> None:
        calls.append(bucket)
        real(self, bucket)

    def counted_split(self: whole_step.WholeParamStep, bucket: object) -> None:
        splits.append(bucket)
        real_split(self, bucket)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(whole_step.WholeParamStep, "_pipeline", counted))
        stack.enter_context(mock.patch.object(whole_step.WholeParamStep, "_split_step", counted_split))
        if not split:  # as for a Muon whose state holds more than its momentum
            stack.enter_context(mock.patch.object(whole_step.WholeParamStep, "_can_split", lambda s, b: False))
        differ = train(rank, world, "muon", entry)
    return differ, len(calls), len(splits)


@pytest.mark.parametrize("split", [True, False], ids=["split", "whole-tensors"])
@pytest.mark.parametrize("entry", ["fully_shard", "fsdp-orig"])
def test_muon_steps_pipelined_and_bitwise(pool2: WorkerPool, entry: str, split: bool) -> None:
    for rank, (differ, steps, splits) in enumerate(pool2.run(pipelined, entry, split)):
        assert differ == [], f"{entry}, rank {rank}: {differ}"
        assert steps == STEPS - 1, f"{entry}, rank {rank}: {steps} pipelined steps of {STEPS}"
        assert splits == (steps if split else 0), f"{entry}, rank {rank}: {splits} split steps"


def split_traffic(rank: int, world: int) -> tuple[list[tuple[int, int]], dict[str, int], dict[str, int]]:
    """The second step's all-to-alls (bytes received, bytes sent), the matrices' owners, their element counts."""
    torch.manual_seed(0)
    model = MLP()
    numels = {n: p.numel() for n, p in model.named_parameters() if p.ndim == 2}
    for block in (model.inp, model.hidden, model.head):
        fully_shard(block)
    fully_shard(model)
    muon = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.05)
    hook = whole_param_step(model, muon)
    calls: list[tuple[int, int]] = []
    real = dist.all_to_all_single

    def traced(out: torch.Tensor, inp: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append((out.numel() * out.element_size(), inp.numel() * inp.element_size()))
        return real(out, inp, *args, **kwargs)

    for step in range(2):
        model(torch.randn(3, 6)).sum().backward()
        with mock.patch.object(dist, "all_to_all_single", traced) if step == 1 else contextlib.nullcontext():
            muon.step()
        muon.zero_grad()
    return calls, {n: o for n, o in hook.owners.items() if n in numels}, numels


def test_split_muon_exchanges_only_bf16_newton_schulz_input_and_output(pool2: WorkerPool) -> None:
    """Per owner slot one all-to-all in (an owner receives its matrix's bf16 Newton-Schulz input: 2 bytes an
    element) and one out (each rank receives the bf16 result's rows it holds); no parameter, gradient or
    momentum travels, against 12 bytes an element in and 8 out for the whole-tensor exchange."""
    traces = pool2.run(split_traffic)
    for rank, (calls, owners, numels) in enumerate(traces):
        owned = [n for n, o in owners.items() if o == rank]
        slots = max(sum(o == r for o in owners.values()) for r in range(2))
        assert len(calls) == 2 * slots, (rank, calls)
        # posted in order: the gathers of the first two slots, then per slot j the gather of slot j + 2, if any,
        # and slot j's scatter
        kinds = ["in"] * min(2, slots) + [k for j in range(slots) for k in (["in"] * (j + 2 < slots) + ["out"])]
        received_in = sorted(b for (b, _), kind in zip(calls, kinds, strict=True) if kind == "in" and b)
        assert received_in == sorted(2 * numels[n] for n in owned), (rank, owned, calls)
    # in and out, 2 bytes an element each way (an owner's own rows included: all_to_all sends them to itself)
    total = sum(numels.values())
    assert sum(b for calls, _, _ in traces for b, _ in calls) == 2 * 2 * total

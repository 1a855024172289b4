"""Accelerator mixed precision on 2 gloo ranks: bf16 through the engine's policy, fp16 through ShardedGradScaler.

Set up: TinyGPT and the parity spec of ``fullshard.testing.parity``; every rank trains on its half of each
global batch, Accelerate's way (prepare, backward, clip_grad_norm_, step).
Run / Check:
- bf16: the result equals a single-process run of the model cast to bf16 (no autocast), for both
  ``fsdp_version``s; the forward sees bf16 weights and runs without autocast; the master weights stay fp32.
- fp16: an inf injected into rank 1's gradient shard only makes *both* ranks skip that step and halve the
  scale; the other steps (loss scaled, gradients unscaled before clipping) equal a single-process fp16 run
  of the steps that were not skipped.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from fullshard import Accelerator, FullyShardedDataParallelPlugin
from fullshard.testing import WorkerPool
from fullshard.testing.parity import TrainSpec, reference_run

BF16_SPEC = TrainSpec(optimizer="sgd", lr=0.1, compute_dtype=torch.bfloat16, steps=4)
FP16_SPEC = TrainSpec(optimizer="sgd", lr=0.1, compute_dtype=torch.float16, steps=3, clip=1.0)
OVERFLOW_STEP = 1  # the step whose gradients get an inf on rank 1


def _plugin(version: int) -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(
        fsdp_version=version, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train_mixed(rank: int, world: int, version: int, precision: str, spec: TrainSpec) -> dict[str, Any]:
    """Train ``spec`` with ``Accelerator(mixed_precision=precision)``; inject an inf on rank 1 for fp16."""
    accelerator = Accelerator(mixed_precision=precision, fsdp_plugin=_plugin(version))
    model = spec.model()
    seen: list[tuple[torch.dtype, bool]] = []
    model.blocks[0].fc.register_forward_pre_hook(
        lambda m, args: seen.append((m.weight.dtype, torch.is_autocast_enabled("cpu")))
    )
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(spec.make_optimizer(model.parameters()))
    if accelerator.scaler is not None:  # a scale small enough that fp16 gradients do not overflow by themselves
        accelerator.scaler.load_state_dict({**accelerator.scaler.state_dict(), "scale": 1024.0})
    per = spec.batch // world
    record: dict[str, Any] = {"losses": [], "skipped": [], "scales": [], "changed": [], "seen": seen}
    for step in range(spec.steps):
        (x, y) = spec.micro_batches(step)[0]
        before = [_local(p).detach().clone() for p in model.parameters()]
        loss = model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        accelerator.backward(loss)
        if precision == "fp16" and step == OVERFLOW_STEP and rank == 1:
            grad = next(_local(p.grad) for p in model.parameters() if p.grad is not None and _local(p.grad).numel())
            grad.view(-1)[0] = float("inf")
        if spec.clip is not None:
            accelerator.clip_grad_norm_(model.parameters(), spec.clip)
        optimizer.step()
        optimizer.zero_grad()
        record["losses"].append(accelerator.reduce(loss.detach(), reduction="mean").item())
        record["skipped"].append(accelerator.optimizer_step_was_skipped)
        record["scales"].append(accelerator.scaler.get_scale() if accelerator.scaler is not None else None)
        after = [_local(p).detach() for p in model.parameters()]
        record["changed"].append(any(not torch.equal(a, b) for a, b in zip(before, after)))
    record["master_dtypes"] = {p.dtype for p in model.parameters()}
    record["params"] = accelerator.get_state_dict(model)
    return record


def _check_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert got.keys() == want.keys()
    for name, ref in want.items():
        assert got[name].dtype == torch.float32, name
        torch.testing.assert_close(got[name], ref, atol=atol, rtol=1e-2, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
def test_bf16_matches_a_reference_cast_to_bf16(pool2: WorkerPool, version: int) -> None:
    want = reference_run(BF16_SPEC)
    results = pool2.run(train_mixed, version, "bf16", BF16_SPEC)
    got = results[0]
    # bf16 holds ~3 significant digits: a loss near 3.8 is quantized in steps of 1/64.
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want.losses), atol=2e-2, rtol=1e-2)
    _check_params(got["params"], want.params, atol=5e-4)
    for result in results:
        assert set(result["seen"]) == {(torch.bfloat16, False)}, "bf16 weights in forward, and no autocast"
        assert result["master_dtypes"] == {torch.float32}
        assert result["scales"] == [None] * BF16_SPEC.steps, "bf16 needs no loss scaler"


def _reference_skipping(spec: TrainSpec, skipped: int) -> dict[str, torch.Tensor]:
    """``reference_run`` of ``spec`` minus step ``skipped`` (its batch is drawn, its update never made)."""
    model = spec.model()
    opt = spec.make_optimizer(model.parameters())
    for step in range(spec.steps):
        if step == skipped:
            continue
        compute = copy.deepcopy(model).to(spec.compute_dtype)
        x, y = spec.micro_batches(step)[0]
        compute(x, y).backward()
        for master, low in zip(model.parameters(), compute.parameters()):
            master.grad = low.grad.to(master.dtype)
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
def test_fp16_overflow_on_one_rank_skips_the_step_on_all(pool2: WorkerPool, version: int) -> None:
    results = pool2.run(train_mixed, version, "fp16", FP16_SPEC)
    for rank, result in enumerate(results):
        assert result["skipped"] == [False, True, False], f"rank {rank}"
        assert result["changed"] == [True, False, True], f"rank {rank}: the skipped step must not move weights"
        assert result["scales"] == [1024.0, 512.0, 512.0], f"rank {rank}: the scale backs off once, everywhere"
        assert result["master_dtypes"] == {torch.float32}
    _check_params(results[0]["params"], _reference_skipping(FP16_SPEC, OVERFLOW_STEP), atol=2e-4)


def save_and_load_scaler(rank: int, world: int, folder: str) -> tuple[list[str], float, float]:
    def build() -> tuple[Accelerator, Any, Any]:
        accelerator = Accelerator(mixed_precision="fp16", fsdp_plugin=_plugin(2))
        model = accelerator.prepare(FP16_SPEC.model())
        return accelerator, model, accelerator.prepare(FP16_SPEC.make_optimizer(model.parameters()))

    accelerator, model, optimizer = build()
    accelerator.scaler.load_state_dict({**accelerator.scaler.state_dict(), "scale": 150.0})  # after some backoffs
    accelerator.backward(model(*FP16_SPEC.micro_batches(0)[0]))
    optimizer.step()
    accelerator.save_state(folder)
    files = sorted(p.name for p in Path(folder).iterdir())
    restored = build()[0]
    fresh = restored.scaler.get_scale()
    restored.load_state(folder)
    return files, fresh, restored.scaler.get_scale()


def test_fp16_scaler_state_is_checkpointed(pool2: WorkerPool, tmp_path: Path) -> None:
    files, fresh, loaded = pool2.run(save_and_load_scaler, str(tmp_path / "ckpt"))[1]
    assert "scaler.pt" in files
    assert (fresh, loaded) == (2.0**16, 150.0)

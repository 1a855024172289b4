"""The Accelerator members and handlers of seed 002 on 2 gloo ranks, each against a reference: single-process
training on the global batch, torch's DDP with its fp16 hook, torch's GradScaler arithmetic, or Accelerate's
documented results."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fullshard import Accelerator, FullyShardedDataParallelPlugin
from fullshard.engine.collectives import COMM_STATS
from fullshard.testing import RankFailure, WorkerPool
from fullshard.utils import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    ProfileKwargs,
)

WORLD = 2


def mlp(seed: int = 0, width: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, 16), nn.Tanh(), nn.Linear(16, 1))


def batches(step: int, per_rank: int = 4, width: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (rank r's part is rows [r * per_rank, (r + 1) * per_rank))."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * per_rank, width, generator=g) * 3, torch.randn(WORLD * per_rank, 1, generator=g)


def local(rank: int, data: tuple[torch.Tensor, ...], per_rank: int = 4) -> list[torch.Tensor]:
    return [t[rank * per_rank : (rank + 1) * per_rank] for t in data]


def full_params(accelerator: Accelerator, model: nn.Module) -> dict[str, torch.Tensor]:
    state = accelerator.get_state_dict(model)
    return {k: v.clone() for k, v in state.items()}


# --- processes ---------------------------------------------------------------------------------------


def _process_helpers(rank: int, world: int) -> dict[str, Any]:
    accelerator = Accelerator()
    out: dict[str, Any] = {}
    with accelerator.split_between_processes(["A", "B", "C"]) as part:
        out["list"] = part
    with accelerator.split_between_processes(("A", "B", "C"), apply_padding=True) as part:
        out["padded"] = part
    with accelerator.split_between_processes({"x": torch.arange(5), "y": list("abcde")}, apply_padding=True) as part:
        out["dict"] = (part["x"].tolist(), part["y"])

    @accelerator.on_main_process
    def main() -> int:
        return rank

    out["calls"] = [main(), accelerator.on_last_process(lambda: "last")(),
                    accelerator.on_process(process_index=1)(lambda: "one")(),
                    accelerator.on_local_main_process(lambda: "local")()]  # fmt: skip
    return out


def test_split_between_processes_and_process_decorators(pool2: WorkerPool) -> None:
    zero, one = pool2.run(_process_helpers)
    # Accelerate's documented split of ["A", "B", "C"] over 2 processes, without and with padding.
    assert (zero["list"], one["list"]) == (["A", "B"], ["C"])
    assert (zero["padded"], one["padded"]) == (("A", "B"), ("C", "C"))
    assert zero["dict"] == ([0, 1, 2], ["a", "b", "c"]) and one["dict"] == ([3, 4, 4], ["d", "e", "e"])
    assert zero["calls"] == [0, None, None, "local"] and one["calls"] == [None, "last", "one", None]


# --- trackers ----------------------------------------------------------------------------------------


def _log_on_both_ranks(rank: int, world: int, folder: str) -> None:
    accelerator = Accelerator(log_with="jsonl", project_dir=folder)
    accelerator.init_trackers("run", config={"rank": rank})
    for step in range(3):
        accelerator.log({"rank": rank, "loss": float(step)}, step=step)
    accelerator.end_training()


def test_trackers_write_from_rank_0_only(pool2: WorkerPool, tmp_path: Path) -> None:
    pool2.run(_log_on_both_ranks, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["rank"], r["step"]) for r in records] == [(0, 0), (0, 1), (0, 2)]
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"rank": 0}


# --- gradients ---------------------------------------------------------------------------------------


def _reference_clipped(steps: int, clip: float) -> dict[str, torch.Tensor]:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batches(step)
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _clipped(rank: int, world: int, version: int, clip: float) -> dict[str, torch.Tensor]:
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=version))
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(2):
        x, y = local(rank, batches(step))
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        accelerator.clip_grad_value_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return full_params(accelerator, model)


@pytest.mark.parametrize("version", [1, 2])
def test_clip_grad_value_matches_single_process(pool2: WorkerPool, version: int) -> None:
    clip = 0.05  # small enough that most gradient elements are clamped
    got = pool2.run(_clipped, version, clip)[0]
    expected = _reference_clipped(2, clip)
    unclipped = _reference_clipped(2, 1e9)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(unclipped[n], expected[n]) for n in expected)  # clipping did something


def _forced_sync(rank: int, world: int, version: int, trigger: bool) -> tuple[dict[str, torch.Tensor], int]:
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=version))
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = local(rank, batches(0))
    before = COMM_STATS.calls["reduce_scatter"] + COMM_STATS.calls["all_reduce"]
    with accelerator.no_sync(model):
        force = accelerator.trigger_sync_in_backward(model) if trigger else torch.enable_grad()
        with force:
            accelerator.backward(nn.functional.mse_loss(model(x), y))
    reductions = COMM_STATS.calls["reduce_scatter"] + COMM_STATS.calls["all_reduce"] - before
    if not trigger:  # the step of an unsynchronised backward: reduce now (outside no_sync), with zero extra grads
        accelerator.backward(0.0 * model(x).sum())
    optimizer.step()
    return full_params(accelerator, model), reductions


@pytest.mark.parametrize("version", [1, 2])
def test_trigger_sync_in_backward_reduces_inside_no_sync(pool2: WorkerPool, version: int) -> None:
    (forced, reduced), _ = pool2.run(_forced_sync, version, True)
    (_, not_reduced), _ = pool2.run(_forced_sync, version, False)
    assert reduced > 0 and not_reduced == 0
    expected = _reference_clipped(1, 1e9)
    for name, tensor in expected.items():
        torch.testing.assert_close(forced[name], tensor, rtol=1e-5, atol=1e-6)


def _accumulate(rank: int, world: int, sync_each_batch: bool) -> tuple[int, dict[str, torch.Tensor]]:
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin)
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = COMM_STATS.calls["reduce_scatter"]
    for step in range(2):
        x, y = local(rank, batches(step))
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    return COMM_STATS.calls["reduce_scatter"] - before, full_params(accelerator, model)


def test_sync_each_batch_reduces_every_batch_with_the_same_result(pool2: WorkerPool) -> None:
    (each, params_each), _ = pool2.run(_accumulate, True)
    (once, params_once), _ = pool2.run(_accumulate, False)
    assert each == 2 * once > 0
    for name in params_once:
        torch.testing.assert_close(params_each[name], params_once[name], rtol=1e-6, atol=1e-7)


def _scaler(rank: int, world: int) -> list[float]:
    handler = GradScalerKwargs(init_scale=8.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=1)
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[handler])
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scales = [accelerator.scaler.get_scale()]
    for step in range(2):
        x, y = local(rank, batches(step))
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        if step == 1 and rank == 1:  # an overflow on one rank only: every rank must skip
            next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("inf"))
        optimizer.step()
        optimizer.zero_grad()
        scales.append(accelerator.scaler.get_scale())
    return [*scales, float(accelerator.optimizer_step_was_skipped)]


def test_grad_scaler_kwargs_configure_the_fp16_scaler(pool2: WorkerPool) -> None:
    # torch.amp.GradScaler arithmetic: grow x3 after each clean step (growth_interval=1), x0.25 after an overflow.
    assert pool2.run(_scaler) == [[8.0, 24.0, 6.0, 1.0]] * 2


# --- DDP kwargs under NO_SHARD ----------------------------------------------------------------------


def _ddp_fp16_hook(rank: int, world: int, hook: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    x, y = local(rank, batches(0))
    x = x * 30  # large gradients: float16 rounding shows
    reference = nn.parallel.DistributedDataParallel(mlp())
    if hook == "fp16":
        reference.register_comm_hook(None, default_hooks.fp16_compress_hook)
    nn.functional.mse_loss(reference(x), y).backward()
    ddp_grads = {n.removeprefix("module."): p.grad.clone() for n, p in reference.named_parameters()}

    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType(hook), find_unused_parameters=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy="NO_SHARD")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = Accelerator(fsdp_plugin=plugin, kwargs_handlers=[handler])
        model = accelerator.prepare(mlp())
    ignored = [str(w.message) for w in caught if "find_unused_parameters" in str(w.message)]
    assert len(ignored) == (1 if rank == 0 else 0), ignored
    nn.functional.mse_loss(model(x), y).backward()
    with model.summon_full_params(model, with_grads=True):
        ours = {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    return ours, ddp_grads


def test_ddp_fp16_comm_hook_applies_under_no_shard(pool2: WorkerPool) -> None:
    ours, ddp = pool2.run(_ddp_fp16_hook, "fp16")[0]
    plain_ours, plain_ddp = pool2.run(_ddp_fp16_hook, "no")[0]
    for name in ddp:
        torch.testing.assert_close(ours[name], ddp[name], rtol=0, atol=0)
        torch.testing.assert_close(plain_ours[name], plain_ddp[name], rtol=1e-6, atol=1e-5)
    assert any(not torch.equal(ours[n], plain_ours[n]) for n in ddp)  # the float16 round trip is visible


def _power_sgd(rank: int, world: int) -> None:
    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy="NO_SHARD")
    Accelerator(fsdp_plugin=plugin, kwargs_handlers=[handler]).prepare(mlp())


def test_power_sgd_is_refused_by_name(pool2: WorkerPool) -> None:
    with pytest.raises(RankFailure, match=re.escape("comm_hook='power_sgd', comm_wrapper='no'): PowerSGD keeps")):
        pool2.run(_power_sgd)


# --- checkpoint hooks, several models, free_memory, join, profile -----------------------------------


def _hooks_and_two_models(rank: int, world: int, folder: str) -> dict[str, Any]:
    accelerator = Accelerator()
    calls: list[tuple] = []
    save = accelerator.register_save_state_pre_hook(
        lambda models, weights, out: calls.append(("save", len(models), weights, out))
    )
    accelerator.register_load_state_pre_hook(lambda models, inp: calls.append(("load", len(models), inp)))
    a, b = mlp(0), mlp(1)
    a, b, opt_a, opt_b = accelerator.prepare(a, b, torch.optim.SGD(a.parameters(), lr=0.1),
                                             torch.optim.SGD(b.parameters(), lr=0.2))  # fmt: skip
    for step in range(2):
        x, y = local(rank, batches(step))
        accelerator.backward(nn.functional.mse_loss(a(x) + b(x), y))
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    accelerator.save_state(folder)
    save.remove()
    accelerator.save_state(folder)
    accelerator.load_state(folder)
    result = {"calls": calls, "a": full_params(accelerator, a), "b": full_params(accelerator, b)}
    released = accelerator.free_memory(a, b, opt_a, opt_b)
    result["released"] = released
    model = accelerator.prepare(mlp())
    result["after_free"] = len(accelerator._objects.models), model is not None
    return result


def test_save_load_hooks_and_two_models(pool2: WorkerPool, tmp_path: Path) -> None:
    got = pool2.run(_hooks_and_two_models, str(tmp_path / "ckpt"))[0]
    # the pre-save hook writes into the save's staging folder (committed with the checkpoint), the load hook reads
    # the committed one
    staging = str(tmp_path / "ckpt.incomplete")
    assert got["calls"] == [("save", 2, [], staging), ("load", 2, str(tmp_path / "ckpt"))]
    a, b = mlp(0), mlp(1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.2)
    for step in range(2):
        x, y = batches(step)
        nn.functional.mse_loss(a(x) + b(x), y).backward()
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    for ours, model in ((got["a"], a), (got["b"], b)):
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6)
    assert got["released"] == [None] * 4 and got["after_free"] == (1, True)


def _join(rank: int, world: int) -> tuple[list[bool], str]:
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2))
    seen = []
    with accelerator.join_uneven_inputs([], even_batches=True):
        seen.append(loader.batch_sampler.even_batches)
    accelerator.even_batches = False
    loader2 = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2))
    with accelerator.join_uneven_inputs([], even_batches=True):
        seen.append(loader2.batch_sampler.even_batches)
    seen.append(loader2.batch_sampler.even_batches)
    try:
        with accelerator.join_uneven_inputs([], even_batches=False):
            pass
    except ValueError as exc:
        return seen, str(exc)
    return seen, ""


def test_join_uneven_inputs_overrides_even_batches_and_refuses_uneven(pool2: WorkerPool) -> None:
    seen, error = pool2.run(_join)[0]
    assert seen == [True, True, False]
    assert error.startswith("Accelerator.join_uneven_inputs(even_batches=False): a sharded model cannot run uneven")


def _profile(rank: int, world: int, folder: str) -> list[str]:
    accelerator = Accelerator(kwargs_handlers=[ProfileKwargs(activities=["cpu"], output_trace_dir=folder)])
    model = accelerator.prepare(mlp())
    with accelerator.profile() as profiler:
        model(torch.randn(2, 8)).sum().backward()
    return [e.key for e in profiler.key_averages()]


def test_profile_writes_one_trace_per_rank(pool2: WorkerPool, tmp_path: Path) -> None:
    keys = pool2.run(_profile, str(tmp_path))
    assert all(any("addmm" in k for k in ks) for ks in keys)
    for rank in range(WORLD):
        trace = json.loads((tmp_path / f"profile_{rank}.json").read_text())
        assert any("addmm" in e.get("name", "") for e in trace["traceEvents"])

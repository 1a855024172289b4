"""Accelerator end to end on 2 gloo ranks, against single-process training on the full batch.

Set up: TinyGPT and a dataset of token sequences; the reference trains in one process on the global batch
(both ranks' batches, in rank order), with the same optimizer (two param groups) and scheduler.
Run: the same loop written Accelerate's way (prepare, accumulate, backward, clip, step) on 2 ranks.
Check: losses per step, gathered final parameters (get_state_dict), and what the prepared objects report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fullshard import Accelerator, FullyShardedDataParallelPlugin
from fullshard.engine.collectives import COMM_STATS
from fullshard.testing import WorkerPool
from fullshard.testing.models import GPTConfig, TinyGPT

CFG = GPTConfig()
PER_RANK = 2  # batch size of each rank's DataLoader
WORLD = 2


def dataset(n: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, CFG.vocab_size, (n, CFG.block_size + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


def model_and_optimizer(seed: int = 0) -> tuple[TinyGPT, torch.optim.Optimizer, Any]:
    """TinyGPT, AdamW over two param groups (norms without weight decay) and a StepLR."""
    torch.manual_seed(seed)
    model = TinyGPT(CFG)
    norms = [p for n, p in model.named_parameters() if "ln" in n]
    rest = [p for n, p in model.named_parameters() if "ln" not in n]
    groups = [{"params": norms, "weight_decay": 0.0}, {"params": rest, "weight_decay": 0.1}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def plugin(version: int, **kwargs: Any) -> FullyShardedDataParallelPlugin:
    kwargs.setdefault("state_dict_type", "SHARDED_STATE_DICT")
    return FullyShardedDataParallelPlugin(
        fsdp_version=version,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        **kwargs,
    )


def reference(steps: int, accumulate: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: global batch = WORLD * PER_RANK samples; the scheduler steps WORLD times per step."""
    model, optimizer, scheduler = model_and_optimizer()
    loader = DataLoader(dataset(), batch_size=WORLD * PER_RANK)
    losses, batches = [], iter(loader)
    for _ in range(steps):
        total = 0.0
        for _ in range(accumulate):
            x, y = next(batches)
            loss = model(x, y) / accumulate
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        for _ in range(WORLD):
            scheduler.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(rank: int, world: int, version: int, steps: int, accumulate: int, extra: dict[str, Any]) -> Any:
    accelerator = Accelerator(fsdp_plugin=plugin(version, **extra), gradient_accumulation_steps=accumulate)
    model, optimizer, scheduler = model_and_optimizer()
    calls: list[int] = []  # forwards of one inner layer: twice per step when activations are recomputed
    model.blocks[0].fc.register_forward_hook(lambda *_: calls.append(1))
    loader = DataLoader(dataset(), batch_size=PER_RANK)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses, syncs, reduce_calls, total = [], [], [], torch.zeros(())
    for i, (x, y) in enumerate(loader):
        if i == steps * accumulate:
            break
        before = COMM_STATS.calls["reduce_scatter"]
        with accelerator.accumulate(model):
            loss = model(x, y)
            accelerator.backward(loss)
            syncs.append(accelerator.sync_gradients)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        reduce_calls.append(COMM_STATS.calls["reduce_scatter"] - before)
        total += accelerator.reduce(loss.detach(), reduction="mean") / accumulate
        if accelerator.sync_gradients:
            losses.append(total.item())
            total = torch.zeros(())
    groups = [(len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups]
    lrs = scheduler.get_last_lr()
    return losses, accelerator.get_state_dict(model), syncs, reduce_calls, groups, lrs, len(calls)


def assert_matches_reference(results: list[Any], steps: int, accumulate: int = 1) -> None:
    want_losses, want_params = reference(steps, accumulate)
    losses, params = results[0][0], results[0][1]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), atol=1e-5, rtol=1e-5)
    assert results[1][1] == {}, "get_state_dict returns the full state on rank 0 only"
    assert params.keys() == want_params.keys()
    for name, want in want_params.items():
        torch.testing.assert_close(params[name], want, atol=2e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "version, extra",
    [(1, {}), (2, {}), (1, {"activation_checkpointing": True}), (2, {"activation_checkpointing": True})],
    ids=["fsdp1", "fsdp2", "fsdp1-activation-checkpointing", "fsdp2-activation-checkpointing"],
)
def test_training_matches_single_process(pool2: WorkerPool, version: int, extra: dict[str, Any]) -> None:
    results = pool2.run(train, version, 3, 1, extra)
    assert_matches_reference(results, steps=3)
    # The optimizer made before prepare keeps both groups, switched onto the sharded parameters.
    assert results[0][4] == [(10, 0.0), (18, 0.1)]
    assert results[0][5] == [1e-2 * 0.5**3] * 2  # 3 steps x 2 scheduler steps each, halving every 2
    assert results[0][6] == (6 if extra.get("activation_checkpointing") else 3)


def test_accumulate_skips_gradient_sync(pool2: WorkerPool) -> None:
    results = pool2.run(train, 2, 2, 2, {})
    assert_matches_reference(results, steps=2, accumulate=2)
    syncs, reduce_calls = results[0][2], results[0][3]
    assert syncs == [False, True, False, True]
    assert [n > 0 for n in reduce_calls] == syncs, f"reduce-scatters per micro-batch: {reduce_calls}"


# --- dataloaders and gather_for_metrics ------------------------------------------------------------


def iterate(rank: int, world: int, n: int, batch: int, even_batches: bool, drop_last: bool) -> Any:
    """Each rank's batches, what gather_for_metrics returned (with even batches), end flags and len()."""
    accelerator = Accelerator(fsdp_plugin=plugin(2), even_batches=even_batches)
    data = TensorDataset(torch.arange(n))
    loader = accelerator.prepare(DataLoader(data, batch_size=batch, drop_last=drop_last))
    seen, gathered, ends = [], [], []
    for (x,) in loader:
        seen.append(x.tolist())
        ends.append(accelerator.gradient_state.end_of_dataloader)
        if even_batches:  # uneven ranks run different numbers of steps: no collective in the loop
            gathered.extend(accelerator.gather_for_metrics(x).tolist())
    return seen, gathered, ends, len(loader)


def test_dataloader_deals_batches_and_gather_for_metrics_drops_padding(pool2: WorkerPool) -> None:
    (seen0, gathered, ends, n0), (seen1, _, _, n1) = pool2.run(iterate, 11, 2, True, False)
    assert seen0 == [[0, 1], [4, 5], [8, 9]]
    assert seen1 == [[2, 3], [6, 7], [10, 0]]  # the last step is completed from the start
    assert gathered == list(range(11)), "gather_for_metrics must drop the repeated sample"
    assert ends == [False, False, True]
    assert n0 == n1 == 3


def test_dataloader_uneven_and_drop_last(pool2: WorkerPool) -> None:
    (seen0, _, _, n0), (seen1, _, _, n1) = pool2.run(iterate, 10, 4, False, False)
    assert seen0 == [[0, 1, 2, 3], [8, 9]]
    assert seen1 == [[4, 5, 6, 7]]
    assert (n0, n1) == (2, 1)
    (seen0, _, _, n0), (seen1, _, _, _) = pool2.run(iterate, 11, 2, True, True)
    assert seen0 == [[0, 1], [4, 5]] and seen1 == [[2, 3], [6, 7]] and n0 == 2


def gather_objects(rank: int, world: int) -> Any:
    accelerator = Accelerator(fsdp_plugin=plugin(2))
    loader = accelerator.prepare(DataLoader(list(range(3)), batch_size=1, collate_fn=lambda b: [f"s{b[0]}"]))
    return [accelerator.gather_for_metrics(batch) for batch in loader]


def test_gather_for_metrics_objects(pool2: WorkerPool) -> None:
    results = pool2.run(gather_objects)
    assert results[0] == results[1] == [["s0", "s1"], ["s2"]]


# --- checkpoints -----------------------------------------------------------------------------------


class Counter:
    """A registered object: its state is saved in custom_checkpoint_0.pkl."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def run_steps(
    version: int, kind: str, steps: range, seed: int, save: Path | None = None, load: Path | None = None
) -> tuple[list[float], int, list[str]]:
    """Train on the steps given (batch ``i`` of the loader at step ``i``), optionally loading / saving state."""
    accelerator = Accelerator(fsdp_plugin=plugin(version, state_dict_type=kind))
    model, optimizer, scheduler = model_and_optimizer(seed)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if load is not None:
        accelerator.load_state(load)
    batches = list(DataLoader(dataset(), batch_size=WORLD * PER_RANK))
    losses, rank = [], accelerator.process_index
    for step in steps:
        x, y = batches[step]
        loss = model(x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK])
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.count += 1
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    files = []
    if save is not None:
        accelerator.save_state(save)
        files = sorted(p.name for p in save.iterdir())
    return losses, counter.count, files


def resume(rank: int, world: int, version: int, kind: str, folder: str) -> Any:
    straight, _, _ = run_steps(version, kind, range(4), seed=0)
    first, _, files = run_steps(version, kind, range(2), seed=0, save=Path(folder))
    second, count, _ = run_steps(version, kind, range(2, 4), seed=1, load=Path(folder))
    return straight, first + second, count, files


def resume_from_step0(rank: int, world: int, version: int, folder: str) -> Any:
    straight, _, _ = run_steps(version, "SHARDED_STATE_DICT", range(3), seed=0)
    run_steps(version, "SHARDED_STATE_DICT", range(0), seed=0, save=Path(folder))  # before any optimizer step
    resumed, _, _ = run_steps(version, "SHARDED_STATE_DICT", range(3), seed=1, load=Path(folder))
    return straight, resumed


@pytest.mark.parametrize("version", [1, 2])
def test_state_saved_before_the_first_step_resumes(pool2: WorkerPool, tmp_path: Path, version: int) -> None:
    straight, resumed = pool2.run(resume_from_step0, version, str(tmp_path / "ckpt0"))[0]
    assert resumed == straight


@pytest.mark.parametrize("version", [1, 2])
def test_save_state_layout_and_resume_reproduces_losses(pool2: WorkerPool, tmp_path: Path, version: int) -> None:
    results = pool2.run(resume, version, "SHARDED_STATE_DICT", str(tmp_path / "ckpt"))
    straight, resumed, count, files = results[0]
    assert resumed == straight, "resuming must reproduce the uninterrupted run's losses exactly"
    assert count == 4, "the registered object's state was restored"
    assert files == [
        ".fullshard_checkpoint.json",  # the manifest, written last: the save is complete
        "custom_checkpoint_0.pkl",
        "optimizer_0",
        "pytorch_model_fsdp_0",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "scheduler.bin",
    ]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "pytorch_model_fsdp_0").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]


def save_weights(rank: int, world: int, folder: str) -> None:
    accelerator = Accelerator(fsdp_plugin=plugin(1))
    model = accelerator.prepare(model_and_optimizer()[0])
    accelerator.save_model(model, folder, max_shard_size="20KB")


def test_save_model_writes_sharded_safetensors(pool2: WorkerPool, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    pool2.run(save_weights, str(tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) > 1
    merged: dict[str, torch.Tensor] = {}
    for f in tmp_path.glob("*.safetensors"):
        merged.update(load_file(f))
    want = model_and_optimizer()[0].state_dict()
    assert merged.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(merged[name], tensor)


# --- fsdp2 helpers ---------------------------------------------------------------------------------


def load_full(rank: int, world: int) -> Any:
    from fullshard.utils import fsdp2_load_full_state_dict

    accelerator = Accelerator(fsdp_plugin=plugin(2))
    model = accelerator.prepare(model_and_optimizer(seed=5)[0])
    full = model_and_optimizer(seed=7)[0].state_dict() if rank == 0 else {}
    fsdp2_load_full_state_dict(accelerator, model, full)
    return accelerator.get_state_dict(model)


def test_fsdp2_load_full_state_dict_from_rank0(pool2: WorkerPool) -> None:
    got = pool2.run(load_full)[0]
    want = model_and_optimizer(seed=7)[0].state_dict()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, msg=lambda m, n=name: f"{n}: {m}")


def test_full_state_dict_checkpoint_resumes_too(pool2: WorkerPool, tmp_path: Path) -> None:
    straight, resumed, count, files = pool2.run(resume, 2, "FULL_STATE_DICT", str(tmp_path / "ckpt"))[0]
    assert resumed == straight and count == 4
    assert "pytorch_model_fsdp.bin" in files and "optimizer.bin" in files
    saved = torch.load(tmp_path / "ckpt" / "pytorch_model_fsdp.bin", weights_only=True)
    assert saved["wte.weight"].shape == (CFG.vocab_size, CFG.n_embd), "the full tensor, not a shard"

"""Resuming on another number of ranks (issue 27 §2): ``save_state`` on N ranks, ``load_state`` on M.

Set up: TinyGPT, AdamW over two parameter groups, a StepLR scheduler and a shuffled loader of 40 sample indices
(2 per rank per step, ``use_stateful_dataloader``), prepared by the Accelerator (``fsdp_version`` 1 and 2,
``SHARDED_STATE_DICT``); K steps on N ranks, ``save_state`` mid-epoch, then the loader alone to the end of the
next epoch (what the uninterrupted run would be dealt).
Run: a fresh Accelerator on M ranks (other weights, 10x the learning rates) ``load_state``s it, trains one step and
iterates its loader over the same span.
Check: right after loading, the full model and optimizer state, the scheduler and the random states of the ranks
both runs have equal what was saved; the samples dealt from there on are the uninterrupted run's, in order; rank 0
warned once that the world size changed.

Engine level, world-size-invariant mode (``invariant_micro_batches=4``, the wrapper and ``fully_shard``, through
the same ``state_io.save_state`` / ``load_state``): saved on 2 ranks after 2 steps and resumed on 1, 2 and 4, the
weights after 2 more steps are ``torch.equal`` to the uninterrupted 2-rank run's, and nothing is warned.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from fullshard import FSDP
from fullshard.testing import WorkerPool
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch
from fullshard.testing.parity import invariant_gpt
from tests.distributed.test_checkpoint_reshard import assert_same_state, full_states, make_optim

CFG = GPTConfig(tie_weights=True)
N_SAMPLES, BATCH, K = 40, 2, 3
X, Y = make_batch(CFG, N_SAMPLES, seed=7)  # sample i is (X[i], Y[i]); the loader deals indices


def _pool(request: pytest.FixtureRequest, world: int) -> WorkerPool:
    return request.getfixturevalue(f"pool{world}")


def _prepared(version: int, mode: str) -> tuple[Any, ...]:
    from fullshard import Accelerator, DataLoaderConfiguration, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=version,
        state_dict_type="SHARDED_STATE_DICT",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
    )
    accelerator = Accelerator(
        fsdp_plugin=plugin, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    torch.manual_seed(0 if mode == "save" else 9)
    model = TinyGPT(CFG)
    opt = make_optim(model, lr_scale=1.0 if mode == "save" else 10.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = DataLoader(list(range(N_SAMPLES)), batch_size=BATCH, shuffle=True)
    return accelerator, *accelerator.prepare(model, opt, loader, scheduler)


def _train_step(accelerator: Any, model: nn.Module, opt: Any, scheduler: Any, idx: torch.Tensor) -> None:
    accelerator.backward(model(X[idx], Y[idx]))
    opt.step()
    scheduler.step()
    opt.zero_grad()


def _dealt(accelerator: Any, loader: Any, epoch: Iterator[torch.Tensor]) -> list[int]:
    """The samples of every global batch dealt from here (the rest of ``epoch``, an iterator over ``loader``) to
    the end of the next epoch, in order (a collective); -1 ends an epoch."""
    samples: list[int] = []
    for batches in (epoch, loader):
        samples += [i for idx in batches for i in accelerator.gather(idx).tolist()]
        samples.append(-1)
    return samples


def accelerator_save(rank: int, world: int, version: int, root: str) -> dict[str, Any]:
    accelerator, model, opt, loader, scheduler = _prepared(version, "save")
    epoch = iter(loader)
    for _ in range(K):
        _train_step(accelerator, model, opt, scheduler, next(epoch))
    rng = torch.get_rng_state()
    accelerator.save_state(root)
    state = full_states(model, opt.optimizer)
    return {
        "state": state,
        "scheduler": scheduler.state_dict(),
        "rng": rng,
        "dealt": _dealt(accelerator, loader, epoch),
    }


def accelerator_load(rank: int, world: int, version: int, root: str) -> dict[str, Any]:
    accelerator, model, opt, loader, scheduler = _prepared(version, "load")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state(root)
    rng = torch.get_rng_state()
    state = full_states(model, opt.optimizer)
    sched = scheduler.state_dict()
    epoch = iter(loader)
    first = next(epoch)
    _train_step(accelerator, model, opt, scheduler, first)  # the resharded optimizer state steps
    return {
        "state": state,
        "scheduler": sched,
        "rng": rng,
        "dealt": accelerator.gather(first).tolist() + _dealt(accelerator, loader, epoch),
        "warnings": [str(w.message) for w in caught if "processes" in str(w.message)],
    }


def _real(dealt: list[int], consumed: int) -> list[list[int]]:
    """Each epoch's real samples: the padding ``even_batches`` adds to a short last global batch dropped."""
    epochs, current = [], []
    for i in dealt:
        if i == -1:
            epochs.append(current)
            current = []
        else:
            current.append(i)
    return [epochs[0][: N_SAMPLES - consumed], epochs[1][:N_SAMPLES]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    cache: dict[tuple[int, int], tuple[Path, list[dict[str, Any]]]] = {}

    def get(version: int, world: int) -> tuple[Path, list[dict[str, Any]]]:
        if (version, world) not in cache:
            root = tmp_path_factory.mktemp(f"v{version}-n{world}") / "ckpt"
            cache[version, world] = (root, _pool(request, world).run(accelerator_save, version, str(root)))
        return cache[version, world]

    return get


@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
@pytest.mark.parametrize(("saving", "loading"), [(2, 1), (2, 4), (4, 2)], ids=["2to1", "2to4", "4to2"])
def test_accelerator_resumes_on_another_world_size(
    request: pytest.FixtureRequest, saved: Any, version: int, saving: int, loading: int
) -> None:
    # - Set up: K steps and save_state on `saving` ranks, then the samples the uninterrupted run is dealt
    root, before = saved(version, saving)
    # - Run: load_state on `loading` ranks
    after = _pool(request, loading).run(accelerator_load, version, str(root))
    # - Check
    for rank, got in enumerate(after):
        assert_same_state(got["state"], before[0]["state"])
        assert got["scheduler"] == before[0]["scheduler"]
        if rank < saving:
            assert torch.equal(got["rng"], before[rank]["rng"]), f"rank {rank}: random state not restored"
        consumed = K * BATCH * saving
        assert _real(got["dealt"], consumed) == _real(before[0]["dealt"], consumed), "other samples than straight on"
    assert len(after[0]["warnings"]) == 1, after[0]["warnings"]
    line = after[0]["warnings"][0]
    assert f"saved by {saving} processes and is loaded by {loading}" in line
    assert f"results will differ from a {saving}-process run from here on" in line
    assert "\n" not in line and all(not got["warnings"] for got in after[1:])


# --- engine level, world-size-invariant mode: bitwise across the resume ------------------------------------

INV_CFG = GPTConfig(n_embd=40, n_head=4)
G, MICRO_ROWS, SAVE_AT, STEPS = 4, 2, 2, 4


def _invariant_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, step: int) -> None:
    x, y = make_batch(INV_CFG, G * MICRO_ROWS, seed=1000 + step)  # the global batch; micro-batch g: rows 2g, 2g+1
    per_rank = G // world
    for k in range(per_rank):
        g = rank * per_rank + k
        (
            model(x[g * MICRO_ROWS : (g + 1) * MICRO_ROWS], y[g * MICRO_ROWS : (g + 1) * MICRO_ROWS]) / per_rank
        ).backward()
    opt.step()
    opt.zero_grad()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def invariant_run(rank: int, world: int, entry: str, root: str, mode: str) -> dict[str, Any]:
    """``mode``: "straight" (STEPS steps), "save" (SAVE_AT steps, then save_state) or "resume" (load, the rest)."""
    from fullshard import FullyShardedDataParallelPlugin
    from fullshard.frontend.saving import state_io

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2 if entry == "fully_shard" else 1, state_dict_type="SHARDED_STATE_DICT"
    )
    model = invariant_gpt(entry, INV_CFG, G, seed=9 if mode == "resume" else 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2 if mode != "resume" else 1.0)
    objects = state_io.TrainingObjects(models=[model], optimizers=[opt])
    caught: list[Any] = []
    steps = range(STEPS)
    if mode == "resume":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state_io.load_state(root, objects, plugin)
        steps = range(SAVE_AT, STEPS)
    for step in steps if mode != "save" else range(SAVE_AT):
        _invariant_step(model, opt, rank, world, step)
    if mode == "save":
        state_io.save_state(root, objects, plugin)
    return {"params": _params(model), "warnings": [str(w.message) for w in caught]}


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_invariant_mode_resumes_bitwise_on_1_2_4_ranks(
    request: pytest.FixtureRequest, tmp_path: Path, entry: str
) -> None:
    # - Set up: the uninterrupted 2-rank run, and one saved after SAVE_AT steps
    straight = _pool(request, 2).run(invariant_run, entry, "", "straight")[0]["params"]
    pool2: WorkerPool = _pool(request, 2)
    pool2.run(invariant_run, entry, str(tmp_path / "ckpt"), "save")
    # - Run: resume on 1, 2 and 4 ranks
    for world in (1, 2, 4):
        results = _pool(request, world).run(invariant_run, entry, str(tmp_path / "ckpt"), "resume")
        # - Check: bitwise the uninterrupted run's weights on every rank; no world-size warning
        for rank, got in enumerate(results):
            assert sorted(got["params"]) == sorted(straight)
            for name, value in straight.items():
                assert torch.equal(got["params"][name], value), f"{entry}: resumed on {world}, rank {rank}: {name}"
            assert not got["warnings"], got["warnings"]

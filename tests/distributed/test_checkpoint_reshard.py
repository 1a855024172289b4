"""The resharding matrix on disk: model and optimizer saved in Accelerate's layout, loaded elsewhere, trained on.

Set up: TinyGPT (tied weights, no dim 0 divisible by 2 or 4), AdamW over two param groups of different
hyperparameters, K steps on the saving layout; ``save_sharded`` writes ``pytorch_model_fsdp_0/`` ({"model":
sharded model state dict}) and ``optimizer_0/`` ({"optimizer": sharded optimizer state dict}).
Run: a fresh process layout (another world size, strategy or entry point; or one plain process) builds the
model from other weights and the optimizer with other learning rates, creates the optimizer's state
(``init_optimizer_state``), loads both folders with ``load_sharded`` and trains M more steps.
Check: right after loading, the full model and optimizer state equal bitwise what was saved; the next losses
equal the single-process reference within fp32 tolerance, and bitwise an uninterrupted run of the same
layout when world and strategy are the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fullshard import FSDP, FullStateDictConfig, OptimStateKeyType, StateDictType
from fullshard.algorithms.optim_init import init_optimizer_state
from fullshard.checkpoint import load_sharded, model_folder_name, optimizer_folder_name, save_sharded
from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.testing.parity import fully_shard_blocks
from fullshard.wrap import ModuleWrapPolicy

CFG = GPTConfig(tie_weights=True)
BATCH, K, M = 8, 2, 2
SHARDED = StateDictType.SHARDED_STATE_DICT


def make(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(CFG)


def shard(model: nn.Module, layout: str) -> nn.Module:
    """``fully_shard`` per block and at the root, or the wrapper with the named strategy (HYBRID: 2 x 2)."""
    if layout == "plain":
        return model
    if layout == "fully_shard":
        return fully_shard_blocks(model)
    mesh = init_device_mesh("cpu", (2, 2)) if layout == "HYBRID_SHARD" else None
    return FSDP(model, sharding_strategy=layout, device_mesh=mesh, auto_wrap_policy=ModuleWrapPolicy({Block}))


def make_optim(model: nn.Module, lr_scale: float = 1.0) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    decay = [p for n, p in named if n.endswith("weight") and "ln" not in n]
    rest = [p for n, p in named if not (n.endswith("weight") and "ln" not in n)]
    groups = [
        {"params": decay, "weight_decay": 0.1, "lr": 1e-2 * lr_scale},
        {"params": rest, "weight_decay": 0.0, "lr": 5e-3 * lr_scale},
    ]
    return torch.optim.AdamW(groups)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """Each rank trains on its contiguous slice of the global batch (a plain model on all of it)."""
    sharded = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    per = BATCH // world
    losses = []
    for step in steps:
        x, y = make_batch(CFG, BATCH, seed=step)
        loss = model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if sharded:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _cloned(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    return value.detach().clone() if torch.is_tensor(value) else value


def full_states(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Copies of the full model and optimizer state dicts (by parameter name) on every rank; a collective."""
    if not dist.is_initialized():
        osd = FSDP.rekey_optim_state_dict(opt.state_dict(), OptimStateKeyType.PARAM_NAME, model, optim=opt)
        return _cloned(model.state_dict()), _cloned(osd)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        weights = model.state_dict()
    return _cloned(weights), _cloned(FSDP.full_optim_state_dict(model, opt, rank0_only=False))


# --- save, load ---------------------------------------------------------------------------------------


def save(rank: int, world: int, layout: str, root: str) -> tuple[list[float], dict[str, Any], dict[str, Any]]:
    model = shard(make(), layout)
    opt = make_optim(model)
    losses = train(model, opt, range(K))
    with FSDP.state_dict_type(model, SHARDED):
        save_sharded({"model": model.state_dict()}, Path(root) / model_folder_name(0))
        save_sharded({"optimizer": FSDP.optim_state_dict(model, opt)}, Path(root) / optimizer_folder_name(0))
    return (losses, *full_states(model, opt))


def load_into(model: nn.Module, opt: torch.optim.Optimizer, root: str) -> None:
    """The resume recipe: create the optimizer's state, then fill model and optimizer from the folders."""
    init_optimizer_state(opt)
    if not dist.is_initialized():  # one plain process: the optimizer state dict keyed by name, as saved
        model_sd = {"model": model.state_dict()}
        load_sharded(model_sd, Path(root) / model_folder_name(0))
        model.load_state_dict(model_sd["model"])
        by_name = FSDP.rekey_optim_state_dict(opt.state_dict(), OptimStateKeyType.PARAM_NAME, model, optim=opt)
        optim_sd = {"optimizer": by_name}
        load_sharded(optim_sd, Path(root) / optimizer_folder_name(0))
        by_id = FSDP.rekey_optim_state_dict(optim_sd["optimizer"], OptimStateKeyType.PARAM_ID, model, optim=opt)
        opt.load_state_dict(by_id)
        return
    with FSDP.state_dict_type(model, SHARDED):
        model_sd = {"model": model.state_dict()}
        load_sharded(model_sd, Path(root) / model_folder_name(0))
        model.load_state_dict(model_sd["model"])
        optim_sd = {"optimizer": FSDP.optim_state_dict(model, opt)}
        load_sharded(optim_sd, Path(root) / optimizer_folder_name(0))
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, optim_sd["optimizer"]))


def load(rank: int, world: int, layout: str, root: str) -> tuple[list[float], dict[str, Any], dict[str, Any]]:
    # Other weights and 10x the learning rates: only the checkpoint can make the losses match.
    model = shard(make(seed=9), layout)
    opt = make_optim(model, lr_scale=10.0)
    load_into(model, opt, root)
    weights, osd = full_states(model, opt)
    return train(model, opt, range(K, K + M)), weights, osd


def uninterrupted(rank: int, world: int, layout: str) -> list[float]:
    model = shard(make(), layout)
    return train(model, make_optim(model), range(K + M))


def reference() -> list[float]:
    model = make()
    return train(model, make_optim(model), range(K + M))


def assert_same_state(got: tuple[dict[str, Any], dict[str, Any]], want: tuple[dict[str, Any], dict[str, Any]]) -> None:
    (got_w, got_o), (want_w, want_o) = got, want
    assert list(got_w) == list(want_w)
    for key, value in want_w.items():
        assert torch.equal(got_w[key], value), f"model {key} differs after loading"
    assert got_o["param_groups"] == want_o["param_groups"], "hyperparameters (lr) come from the checkpoint"
    assert list(got_o["state"]) == list(want_o["state"])
    for name, state in want_o["state"].items():
        assert list(got_o["state"][name]) == list(state)
        for key, value in state.items():
            assert torch.equal(got_o["state"][name][key], value), f"optimizer {name}.{key} differs after loading"


POOLS = {2: "pool2", 4: "pool4"}

MATRIX = [
    # (saving layout, its world) -> (loading layout, its world)
    (("fully_shard", 2), ("fully_shard", 4)),
    (("FULL_SHARD", 2), ("SHARD_GRAD_OP", 4)),
    (("SHARD_GRAD_OP", 2), ("HYBRID_SHARD", 4)),
    (("HYBRID_SHARD", 4), ("FULL_SHARD", 2)),
    (("FULL_SHARD", 2), ("fully_shard", 2)),
    (("fully_shard", 2), ("HYBRID_SHARD", 4)),
    (("SHARD_GRAD_OP", 2), ("plain", 1)),
    (("fully_shard", 2), ("plain", 1)),
]


def _run(request: pytest.FixtureRequest, world: int, layout: str, fn: Any, *args: Any) -> list[Any]:
    if world == 1:
        return [fn(0, 1, layout, *args)]
    pool: WorkerPool = request.getfixturevalue(POOLS[world])
    return pool.run(fn, layout, *args)


@pytest.mark.parametrize(("source", "target"), MATRIX, ids=lambda s: f"{s[0]}x{s[1]}")
def test_reshard_matrix_continues_like_the_reference(
    request: pytest.FixtureRequest, tmp_path: Path, source: tuple[str, int], target: tuple[str, int]
) -> None:
    # - Set up: K steps on the saving layout, saved in Accelerate's folders
    saved = _run(request, source[1], source[0], save, str(tmp_path))[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer_0", "pytorch_model_fsdp_0"]
    # - Run: load on the other layout and train on
    results = _run(request, target[1], target[0], load, str(tmp_path))
    # - Check: exact state after loading; losses within fp32 tolerance of the single-process reference
    want = reference()
    torch.testing.assert_close(torch.tensor(saved[0]), torch.tensor(want[:K]), atol=1e-5, rtol=1e-5)
    for losses, weights, osd in results:
        assert_same_state((weights, osd), saved[1:])
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want[K:]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("layout", "world"), [("FULL_SHARD", 2), ("fully_shard", 2), ("HYBRID_SHARD", 4)])
def test_same_layout_continues_bitwise(request: pytest.FixtureRequest, tmp_path: Path, layout: str, world: int) -> None:
    saved = _run(request, world, layout, save, str(tmp_path))[0]
    results = _run(request, world, layout, load, str(tmp_path))
    straight = _run(request, world, layout, uninterrupted)[0]
    assert saved[0] == straight[:K]
    for losses, _, _ in results:
        assert losses == straight[K:], "same world and strategy: training continues bitwise"


# --- through the Accelerator: save_state on 2 ranks, load_state on 4 with the other entry point ------------


def accelerator_run(rank: int, world: int, version: int, root: str, mode: str) -> Any:
    import warnings

    from fullshard import Accelerator, FullyShardedDataParallelPlugin

    strategy = "SHARD_GRAD_OP" if version == 1 else "FULL_SHARD"
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=version,
        sharding_strategy=strategy,
        state_dict_type="SHARDED_STATE_DICT",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
    )
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = make(seed=0 if mode == "save" else 9)
    model, opt = accelerator.prepare(model, make_optim(model, lr_scale=1.0 if mode == "save" else 10.0))
    if mode == "save":
        losses = train(model, opt, range(K))
        accelerator.save_state(root)
        return losses, *full_states(model, opt.optimizer)
    if mode == "damaged":
        before = full_states(model, opt.optimizer)[0]
        try:
            accelerator.load_state(root)
        except FileNotFoundError as exc:
            after = full_states(model, opt.optimizer)[0]
            return str(exc), all(torch.equal(after[k], v) for k, v in before.items())
        return "no error", False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state(root)
    loaded = full_states(model, opt.optimizer)
    said = [str(w.message) for w in caught if "processes" in str(w.message)]
    return train(model, opt, range(K, K + M)), *loaded, said


@pytest.mark.parametrize("versions", [(2, 1), (1, 2)], ids=["fully_shard-to-wrapper", "wrapper-to-fully_shard"])
def test_accelerator_state_reshards_2_to_4(
    pool2: WorkerPool, pool4: WorkerPool, tmp_path: Path, versions: tuple[int, int]
) -> None:
    # - Set up: K steps and save_state on 2 ranks
    saved = pool2.run(accelerator_run, versions[0], str(tmp_path), "save")[0]
    # - Run: load_state on 4 ranks with the other entry point, M more steps
    results = pool4.run(accelerator_run, versions[1], str(tmp_path), "load")
    # - Check: the exact state; the reference's losses; rank 0 says once that the world size changed, and that
    #   ranks 2 and 3 had no random states
    want = reference()
    for losses, weights, osd, _ in results:
        assert_same_state((weights, osd), saved[1:])
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want[K:]), atol=1e-5, rtol=1e-5)
    assert len(results[0][3]) == 1 and "ranks [2, 3] had no random states saved" in results[0][3][0]
    assert all(not r[3] for r in results[1:])


# --- bad input: refused on every rank, naming keys, shapes or files, before anything is modified -----------


def load_mismatched(rank: int, world: int, layout: str, root: str, what: str) -> tuple[str, bool]:
    """Load ``root`` into a model it does not fit (or from a damaged folder); the error and whether it was untouched."""
    cfg = GPTConfig(tie_weights=True, n_layer=3, vocab_size=41) if what == "model" else CFG
    torch.manual_seed(9)
    model = shard(TinyGPT(cfg), layout)
    opt = make_optim(model)
    before = full_states(model, opt)
    try:
        load_into(model, opt, root)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        message = str(exc)
    else:
        message = "no error"
    after = full_states(model, opt)
    same_weights = all(torch.equal(after[0][k], v) for k, v in before[0].items())
    # init_optimizer_state ran first: the optimizer holds its zero template, nothing from the checkpoint
    zero_state = all(not torch.count_nonzero(v) for s in after[1]["state"].values() for v in s.values())
    return message, same_weights and zero_state


@pytest.mark.parametrize("layout", ["fully_shard", "FULL_SHARD"])
def test_mismatched_model_is_refused_naming_keys_and_shapes(pool2: WorkerPool, tmp_path: Path, layout: str) -> None:
    # - Set up: a checkpoint of a 2-layer, 37-token model
    pool2.run(save, layout, str(tmp_path))
    # - Run: load it into a 3-layer, 41-token model
    results = pool2.run(load_mismatched, layout, str(tmp_path), "model")
    # - Check: every rank raises the same error, naming the keys and shapes; nothing was modified
    for message, untouched in results:
        assert message.startswith(f"load_sharded(checkpoint_dir='{tmp_path / 'pytorch_model_fsdp_0'}'): the checkpoint")
        assert "Missing from the checkpoint: ['model.blocks.2.attn.weight'," in message
        assert "model.wte.weight: checkpoint (37, 15), target (41, 15)" in message
        assert untouched


def test_missing_rank_file_is_refused_naming_it(pool2: WorkerPool, tmp_path: Path) -> None:
    pool2.run(save, "FULL_SHARD", str(tmp_path))
    missing = tmp_path / "optimizer_0" / "__1_0.distcp"
    missing.unlink()
    for message, untouched in pool2.run(load_mismatched, "fully_shard", str(tmp_path), "file"):
        assert message == f"{missing} is missing: the checkpoint in {missing.parent} is incomplete; re-save it."
        assert not untouched, "the model folder was whole and loaded; the optimizer folder was refused"


def test_accelerator_refuses_a_damaged_checkpoint_before_loading_anything(pool2: WorkerPool, tmp_path: Path) -> None:
    # - Set up: save_state, then lose rank 1's optimizer shard file
    pool2.run(accelerator_run, 2, str(tmp_path), "save")
    missing = tmp_path / "optimizer_0" / "__1_0.distcp"
    missing.unlink()
    # - Run / Check: every rank refuses, naming the file; the model was not loaded either
    for message, model_untouched in pool2.run(accelerator_run, 2, str(tmp_path), "damaged"):
        assert message == f"{missing} is missing: the checkpoint in {missing.parent} is incomplete; re-save it."
        assert model_untouched

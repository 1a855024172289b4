"""CPU offload, prefetch and its rate limit, forward-order checks, deferred init, activation checkpointing,
communication hooks, frozen parameters and the sharded gradient scaler, each against a reference."""

from __future__ import annotations

import ctypes
import functools
import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from fullshard import (
    FSDP,
    CPUOffload,
    CPUOffloadPolicy,
    ShardedGradScaler,
    apply_activation_checkpointing,
    fully_shard,
)
from fullshard.algorithms.checkpointing import checkpoint_module
from fullshard.comm_hooks import (
    DefaultState,
    LowPrecisionState,
    allreduce_hook,
    bf16_compress_hook,
    reduce_scatter_hook,
)
from fullshard.engine import shm
from fullshard.engine.collectives import COMM_STATS
from fullshard.engine.unit_state import unit_state
from fullshard.frontend.prepare import switch_optimizer_to_sharded
from fullshard.testing import RankFailure, WorkerPool
from fullshard.testing.memory import peak_rss_bytes, reset_peak_rss
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.testing.parity import RunResult, TrainSpec, fully_shard_blocks, reference_run, sharded_run
from fullshard.wrap import ModuleWrapPolicy

ATOL, RTOL = 2e-5, 1e-4
SPEC = TrainSpec()


def assert_parity(got: RunResult, want: RunResult, atol: float = ATOL) -> None:
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), atol=1e-5, rtol=1e-5)
    for name, ref in want.params.items():
        torch.testing.assert_close(got.params[name], ref, atol=atol, rtol=RTOL, msg=name)


def _run(rank: int, world: int, spec: TrainSpec, shard: object, no_sync: bool = False) -> RunResult:
    return sharded_run(rank, world, spec, shard, use_no_sync=no_sync)


@pytest.fixture(scope="module")
def reference() -> RunResult:
    return reference_run(SPEC)


# --- CPU offload --------------------------------------------------------------------------------------


def wrap_offload(model: nn.Module, entry: str) -> nn.Module:
    if entry == "fsdp":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), cpu_offload=CPUOffload(offload_params=True))
    policy = CPUOffloadPolicy(pin_memory=False)
    return fully_shard_blocks(model, offload_policy=policy)


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_offload_parity_with_accumulation_outside_no_sync(pool2: WorkerPool, entry: str) -> None:
    spec = TrainSpec(accumulate=2)
    want = reference_run(spec)
    for got in pool2.run(_run, spec, functools.partial(wrap_offload, entry=entry), False):
        assert_parity(got, want)


def _where_tensors_live(rank: int, world: int) -> dict[str, set[str]]:
    model = wrap_offload(TinyGPT(GPTConfig()), "fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = make_batch(model.cfg, 2, 0)
    model(x, y).backward()
    opt.step()
    group = unit_state(model.blocks[0]).group
    return {
        "params": {p.device.type for p in model.parameters()},
        "grads": {p.grad.device.type for p in model.parameters()},
        "optim": {v.device.type for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)},
        "storage": {group.storage_device.type},
        "compute": {group.device.type},
    }


def test_offloaded_tensors_live_on_cpu(pool2: WorkerPool) -> None:
    where = pool2.run(_where_tensors_live)[0]
    assert where["params"] == where["grads"] == where["optim"] == where["storage"] == {"cpu"}


def _pin_warning(rank: int, world: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fully_shard(nn.Linear(3, 3), offload_policy=CPUOffloadPolicy(pin_memory=True))
    return [str(w.message) for w in caught]


def test_offload_option_that_cannot_be_honoured_warns(pool2: WorkerPool) -> None:
    messages = pool2.run(_pin_warning)[0]
    assert any(m.startswith("CPUOffloadPolicy(pin_memory=True) has no effect here") for m in messages)


def _offload_bool(rank: int, world: int) -> None:
    FSDP(nn.Linear(3, 3), cpu_offload=True)


def test_offload_must_be_a_config(pool2: WorkerPool) -> None:
    with pytest.raises(RankFailure, match=re.escape("FullyShardedDataParallel(cpu_offload=True): pass CPUOffload")):
        pool2.run(_offload_bool)


# --- prefetch -----------------------------------------------------------------------------------------


def wrap_prefetch(model: nn.Module, prefetch: str | None, forward: bool, limit: bool = True) -> nn.Module:
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        backward_prefetch=prefetch,
        forward_prefetch=forward,
        limit_all_gathers=limit,
    )


@pytest.mark.parametrize(("prefetch", "forward"), [("BACKWARD_PRE", True), ("BACKWARD_POST", False), (None, False)])
def test_prefetch_modes_keep_parity(
    pool2: WorkerPool, reference: RunResult, prefetch: str | None, forward: bool
) -> None:
    shard = functools.partial(wrap_prefetch, prefetch=prefetch, forward=forward)
    for got in pool2.run(_run, SPEC, shard):
        assert_parity(got, reference)


def _gathered_at_once(rank: int, world: int, limit: bool) -> dict[str, object]:
    torch.manual_seed(0)
    model = wrap_prefetch(TinyGPT(GPTConfig(n_layer=4)), "BACKWARD_PRE", True, limit)
    x, y = make_batch(model.cfg, 2, 0)
    for _ in range(2):
        model(x, y).backward()
    ctx = unit_state(model).ctx
    order = [s.label for s in ctx.order.units]
    return {"max": ctx.max_gathered, "order": order}


def test_forward_order_is_recorded_and_rate_limited(pool2: WorkerPool) -> None:
    got = pool2.run(_gathered_at_once, True)[0]
    assert got["order"] == ["<root TinyGPT>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert got["max"] == 2  # the current unit and one prefetched, never more


def _frozen_embedding_gathers(rank: int, world: int, entry: str) -> dict[str, object]:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2)
    model = TinyGPT(cfg)
    model.wte.requires_grad_(False)  # fed token ids: its output needs no gradient, so it has no backward
    if entry == "fsdp":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block, nn.Embedding}), use_orig_params=True)
        embedding = model.module.wte
    else:
        fully_shard(model.wte)
        model = fully_shard_blocks(model)
        embedding = model.wte
    group = unit_state(embedding).group
    in_backward: list[bool] = []
    original = group.unshard

    def counting_unshard() -> None:
        in_backward.append(unit_state(model).ctx.backward.in_backward)
        original()

    group.unshard = counting_unshard
    losses = _two_sgd_steps(model, cfg)
    torch.manual_seed(0)
    reference = TinyGPT(cfg)
    reference.wte.requires_grad_(False)
    ref_losses = _two_sgd_steps(reference, cfg)  # every rank the same batch: the mean is this batch's
    return {"gathers": in_backward, "losses": losses, "ref_losses": ref_losses}


def _two_sgd_steps(model: nn.Module, cfg: GPTConfig) -> list[float]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for step in range(2):
        loss = model(*make_batch(cfg, 2, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_backward_does_not_prefetch_a_unit_without_backward(pool2: WorkerPool, entry: str) -> None:
    # Block 0's pre-backward used to prefetch the unit before it in forward order, the frozen embedding, which
    # then stayed gathered, unused, to the end of backward: [False, True] per step.
    for got in pool2.run(_frozen_embedding_gathers, entry):
        assert got["gathers"] == [False, False], got  # once per forward, never in backward
        torch.testing.assert_close(got["losses"], got["ref_losses"], atol=1e-5, rtol=1e-5)


def _backward_gathers(rank: int, world: int) -> list[str]:
    """The units gathered during the second backward (a gather started, not one found done), in order."""
    from fullshard.engine.group import ShardState

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2)
    model = _linear_units_in_blocks(TinyGPT(cfg))
    model(*make_batch(cfg, 2, 0)).backward()  # records the order
    ctx = unit_state(model).ctx
    names = {id(module): name or "root" for name, module in model.named_modules()}
    gathered: list[str] = []

    def logging(group: object, name: str) -> Callable[[], None]:
        original = group.unshard

        def unshard() -> None:
            if group.state is ShardState.SHARDED and ctx.backward.in_backward:
                gathered.append(name)
            original()

        return unshard

    for state in ctx.states:
        state.group.unshard = logging(state.group, names[id(state.module)])
    model(*make_batch(cfg, 2, 1)).backward()
    return gathered


def test_backward_prefetches_nested_units_in_the_order_their_backward_runs(pool2: WorkerPool) -> None:
    # A block's unit begins forward before its Linear units and ends after them, so its backward begins first
    # and theirs follow, last Linear first. Prefetching in reverse pre-forward order fetched, at each block's
    # pre-backward, the previous block's last Linear (needed a whole block later) and gathered the block's own
    # last Linear on demand.
    want = [f"blocks.{i}.{name}" for i in (1, 0) for name in ("fc_out", "fc", "proj", "attn")]
    for got in pool2.run(_backward_gathers):
        # the blocks' own units (norms) are gathered on demand when their backward begins; drop them
        assert [name for name in got if name.count(".") == 2] == want, got
        assert got.index("blocks.1.fc_out") < got.index("blocks.0"), got  # prefetched before block 0's turn


def _spare_handoffs(rank: int, world: int, prefetch: str | None, entry: str) -> dict[str, object]:
    from fullshard.engine import spare as spare_module

    taken: list[bool] = []
    original_take = spare_module.SpareStorage.take

    def counting_take(self: spare_module.SpareStorage, storage: torch.UntypedStorage, nbytes: int) -> bool:
        taken.append(original_take(self, storage, nbytes))
        return taken[-1]

    def build(use_spare: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig(n_layer=4))
        model = wrap_prefetch(model, prefetch, False) if entry == "FSDP" else fully_shard_blocks(model)
        if not use_spare:
            with torch.no_grad():  # (with autograd on, the root's gathered views would stay registered, as torch)
                model(*make_batch(model.cfg, 2, 0))  # lazy init, then take the spare away from every group
            for state in unit_state(model).ctx.states:
                state.group.spare = None
            model.zero_grad(set_to_none=True)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    runs, held_after = {}, []
    for use_spare in (True, False):
        model, opt = build(use_spare)
        losses = []
        spare_module.SpareStorage.take = counting_take  # type: ignore[method-assign]
        try:
            for step in range(3):
                taken.clear()
                loss = model(*make_batch(model.cfg, 2, step))
                if use_spare:
                    held_after.append(unit_state(model).ctx.spare.nbytes)  # end of forward
                loss.backward()
                if use_spare:
                    held_after.append(unit_state(model).ctx.spare.nbytes)  # end of backward
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        finally:
            spare_module.SpareStorage.take = original_take  # type: ignore[method-assign]
        runs[use_spare] = (losses, [p.detach().clone() for p in model.parameters()], sum(taken))
    same = runs[True][0] == runs[False][0] and all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
    return {"handoffs": runs[True][2], "held_after": held_after, "bitwise_equal": same}


@pytest.mark.parametrize(
    ("prefetch", "entry", "handoffs"),
    [("BACKWARD_PRE", "FSDP", 5), (None, "FSDP", 6), ("BACKWARD_PRE", "fully_shard", 5)],
)
def test_freed_gathers_are_handed_to_the_next_unit(
    pool2: WorkerPool, prefetch: str | None, entry: str, handoffs: int
) -> None:
    # Four equal blocks, in the last step: blocks 1-3 take the memory of blocks 0-2 in forward. In backward
    # (the end of forward dropped the spare) block 3 gathers afresh, and so does block 2 when it is prefetched
    # with it; each later block takes the memory of the block that finished two (prefetch) or one before.
    for got in pool2.run(_spare_handoffs, prefetch, entry):
        assert got["handoffs"] == handoffs
        assert got["held_after"] == [0] * 6  # nothing kept across the end of forward or of backward
        assert got["bitwise_equal"]  # the same losses and parameters as freeing and allocating


def _hooks_removed(rank: int, world: int) -> tuple[int, int, int, int]:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    x = torch.randn(2, 4)
    model(x)  # the hooks run: the first forward makes the model its root
    handles = unit_state(model).hook_handles
    registered = len(model._forward_pre_hooks) + len(model._forward_hooks)
    for handle in handles:
        handle.remove()
    left = len(model._forward_pre_hooks) + len(model._forward_hooks)
    return len(handles), registered, left, len(model[1]._forward_pre_hooks)


def test_fully_shard_hooks_are_removable(pool2: WorkerPool) -> None:
    # The unit's forward pre- and post-hook, and the guard on model[1], whose parameters the root unit holds.
    assert pool2.run(_hooks_removed)[0] == (3, 2, 0, 0)


def _order_changes(rank: int, world: int, debug: bool) -> list[str]:
    import os

    os.environ["FULLSHARD_DEBUG"] = "1" if debug else "0"
    try:
        torch.manual_seed(0)
        model = wrap_prefetch(TinyGPT(GPTConfig(n_layer=3)), "BACKWARD_PRE", True)
        x, y = make_batch(model.cfg, 2, 0)
        model(x, y).backward()
        blocks = model.module.blocks
        blocks[0], blocks[1] = blocks[1], blocks[0]  # the next forward runs units in another order
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x, y).backward()
        return [str(w.message) for w in caught]
    finally:
        os.environ["FULLSHARD_DEBUG"] = "0"


def test_order_change_warns_with_forward_prefetch(pool2: WorkerPool) -> None:
    messages = pool2.run(_order_changes, False)[0]
    assert any(
        m.startswith("forward_prefetch=True, but unit 'blocks.1' ran forward as unit #1, where the first iteration ran")
        for m in messages
    ), messages


def test_order_change_is_an_error_in_debug_mode(pool2: WorkerPool) -> None:
    with pytest.raises(RankFailure, match=re.escape("unit 'blocks.1' ran forward as unit #1, where the first")):
        pool2.run(_order_changes, True)


class TwoPaths(nn.Module):
    """Two same-shaped layers whose order depends on a flag (set differently per rank in the test)."""

    def __init__(self, b_first: bool) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b_first = b_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.b, self.a) if self.b_first else (self.a, self.b)
        return second(first(x))


def _ranks_disagree_on_order(rank: int, world: int) -> None:
    import os

    os.environ["FULLSHARD_DEBUG"] = "1"
    try:
        model = FSDP(TwoPaths(b_first=rank == 1), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        model(torch.randn(2, 4))
    finally:
        os.environ["FULLSHARD_DEBUG"] = "0"


def test_ranks_running_different_orders_are_named(pool2: WorkerPool) -> None:
    # FULLSHARD_DEBUG compares every collective across ranks (engine/collective_check.py), so the first
    # differing gather is named before it runs (same-shaped units would otherwise swap shards silently).
    message = "ranks are out of step. This rank (in forward #"
    with pytest.raises(RankFailure, match=re.escape(message)) as failure:
        pool2.run(_ranks_disagree_on_order)
    assert "rank 0: all_gather of unit 'a'" in str(failure.value) and "rank 1: all_gather of unit 'b'" in str(
        failure.value
    )


# --- deferred initialisation --------------------------------------------------------------------------


def _meta_init(rank: int, world: int, layers: int, width: int) -> dict[str, float]:
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=layers, n_head=4, n_embd=width)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    full_bytes = sum(p.numel() * 4 for p in model.parameters())

    def init(module: nn.Module) -> None:
        module.to_empty(device="cpu", recurse=False)
        for p in module.parameters(recurse=False):
            nn.init.normal_(p, std=0.02)

    # Serve every allocation above 64 KiB by mmap, so that freed tensors leave RSS at once (glibc would
    # otherwise raise this threshold as it sees large frees and keep them in its heap).
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    reset_peak_rss()
    before = peak_rss_bytes()
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), param_init_fn=init)
    grown = peak_rss_bytes() - before
    local = sum(p.numel() * 4 for p in model.parameters())
    return {"grown": grown, "full": full_bytes, "local": local}


def test_meta_init_allocates_about_one_shard(pool2: WorkerPool) -> None:
    for got in pool2.run(_meta_init, 12, 256):
        assert got["local"] <= got["full"] / 2 * 1.02
        # This rank's shard plus one unit materialized at a time, far from the whole model.
        assert got["grown"] < 0.75 * got["full"], got


def _sync_from_rank0(rank: int, world: int) -> RunResult:
    def shard(model: nn.Module) -> nn.Module:
        if rank != 0:
            with torch.device("meta"):
                model = TinyGPT(SPEC.cfg)
        return FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), sync_module_states=True, device_id=torch.device("cpu")
        )

    return sharded_run(rank, world, SPEC, shard)


def test_sync_module_states_from_rank0_with_meta_elsewhere(pool2: WorkerPool, reference: RunResult) -> None:
    for got in pool2.run(_sync_from_rank0):
        assert_parity(got, reference)


def _optimizer_built_on_meta(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    with torch.device("meta" if rank else "cpu"):
        model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8, bias=False))
    model[2].weight = model[0].weight  # an output head tied to its embedding
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # as the Trainer does for FSDP2: before sharding
    fully_shard(model[1], sync_module_states=True)
    fully_shard(model, sync_module_states=True)
    switched = switch_optimizer_to_sharded(optimizer)
    return {
        "switched": switched,
        "optimizer_holds_the_shards": [id(p) for p in optimizer.param_groups[0]["params"]]
        == [id(p) for p in model.parameters()],
        "tied": model[2].weight is model[0].weight,
        "sums": [float(p.full_tensor().sum()) for p in model.parameters()],
    }


def test_optimizer_built_on_a_meta_model_is_switched_to_the_shards(pool2: WorkerPool) -> None:
    # Ranks > 0 on meta (cpu_ram_efficient_loading): materializing a unit keeps each parameter object, so the
    # optimizer built before sharding still finds the shards that replaced them, and the tie survives.
    got = pool2.run(_optimizer_built_on_meta)
    for result in got:
        assert result["switched"] == 3 and result["optimizer_holds_the_shards"] and result["tied"], result
    assert got[0]["sums"] == got[1]["sums"]


def _reset_parameters_default(rank: int, world: int) -> list[float]:
    torch.manual_seed(3)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    with FSDP.summon_full_params(model):
        return [float(p.abs().sum()) for p in model.parameters()]


def test_meta_without_param_init_fn_uses_reset_parameters(pool2: WorkerPool) -> None:
    sums = pool2.run(_reset_parameters_default)
    assert sums[0] == sums[1]
    assert all(s > 0 for s in sums[0])  # initialised, not left as uninitialised zeros/garbage of size 0


class NoReset(nn.Module):
    """Parameters but no reset_parameters(): nothing can initialise it on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _uninitialisable_on_rank0(rank: int, world: int, entry: str) -> None:
    with torch.device("meta"):
        model = NoReset()
    if entry == "fsdp":
        FSDP(model, sync_module_states=True)
    else:
        fully_shard(model, sync_module_states=True)


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_sync_module_states_problem_on_rank0_raises_everywhere(pool2: WorkerPool, entry: str) -> None:
    # Rank 0 cannot initialise the module; the other rank must raise too instead of waiting for a broadcast.
    with pytest.raises(RankFailure) as info:
        pool2.run(_uninitialisable_on_rank0, entry)
    assert set(info.value.failures) == {0, 1}
    assert "sync_module_states=True, unit 'NoReset': on rank 0, NoReset at '<root>' is on the meta device" in str(
        info.value
    )


# --- activation checkpointing -------------------------------------------------------------------------


def wrap_checkpointed(model: nn.Module, entry: str) -> nn.Module:
    assert apply_activation_checkpointing(model, lambda m: isinstance(m, Block)) == len(model.blocks)
    if entry == "fsdp":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    return fully_shard_blocks(model)


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_activation_checkpointing_parity(pool2: WorkerPool, reference: RunResult, entry: str) -> None:
    for got in pool2.run(_run, SPEC, functools.partial(wrap_checkpointed, entry=entry)):
        assert_parity(got, reference)


def _saved_activation_bytes(rank: int, world: int, checkpointed: bool) -> int:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, n_embd=48, block_size=32)
    model = TinyGPT(cfg)
    if checkpointed:
        apply_activation_checkpointing(model, lambda m: isinstance(m, Block))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    x, y = make_batch(cfg, 4, 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    loss.backward()
    return saved


def test_activation_checkpointing_saves_less(pool2: WorkerPool) -> None:
    plain = pool2.run(_saved_activation_bytes, False)[0]
    checkpointed = pool2.run(_saved_activation_bytes, True)[0]
    assert checkpointed < 0.5 * plain, (checkpointed, plain)


def _checkpoint_reentrant(module: nn.Module) -> None:
    forward = module.forward

    def checkpointed(*args: object) -> object:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=True)

    module.forward = checkpointed


def wrap_checkpointed_nested(model: nn.Module, entry: str, reentrant: bool = False) -> nn.Module:
    """Every ``Linear`` of each block a unit of its own inside its block's unit, each block recomputed in backward
    (the layout of LoRA's smallest units): reentrant or not."""
    for block in model.blocks:
        _checkpoint_reentrant(block) if reentrant else checkpoint_module(block)
    if entry == "fsdp":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block, nn.Linear}))
    return _linear_units_in_blocks(model)


def _linear_units_in_blocks(model: TinyGPT) -> nn.Module:
    """``fully_shard`` on every ``Linear`` of each block, then on each block and the model."""
    for block in model.blocks:
        for linear in (block.attn, block.proj, block.fc, block.fc_out):
            fully_shard(linear)
    return fully_shard_blocks(model)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_units_inside_a_recomputed_block_keep_parity(
    pool2: WorkerPool, reference: RunResult, entry: str, reentrant: bool
) -> None:
    wrap = functools.partial(wrap_checkpointed_nested, entry=entry, reentrant=reentrant)
    for got in pool2.run(_run, SPEC, wrap):
        assert_parity(got, reference)


def _gathered_in_backward(rank: int, world: int, entry: str) -> dict[str, int]:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=3)
    model = wrap_checkpointed_nested(TinyGPT(cfg), entry)
    most = {"forward": 0, "backward": 0}
    for step in range(2):
        loss = model(*make_batch(cfg, 2, step))
        ctx = unit_state(model).ctx
        most["forward"] = max(most["forward"], ctx.max_gathered)
        ctx.max_gathered = 0
        loss.backward()
        most["backward"] = max(most["backward"], ctx.max_gathered)
        ctx.max_gathered = 0
        model.zero_grad()
    return most


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_a_recomputed_block_does_not_gather_all_its_units_at_once(pool2: WorkerPool, entry: str) -> None:
    # Recomputing a block runs all four of its Linear units' forwards before any of their backwards. Kept
    # gathered from there on (as before), the block, its four units and one prefetched were gathered together
    # (6). Now each is freed after its recomputed forward and gathered again for its own backward: at most the
    # block, the unit whose backward triggered the recomputation, the one prefetched and the one recomputed.
    for got in pool2.run(_gathered_in_backward, entry):
        assert got["backward"] <= 4, got
        assert got["forward"] <= 2, got  # limit_all_gathers, as without recomputation


# --- communication hooks ------------------------------------------------------------------------------


def wrap_with_hook(model: nn.Module, hook_name: str, strategy: str = "FULL_SHARD") -> nn.Module:
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy)
    if hook_name == "default":
        model.register_comm_hook(DefaultState(dist.group.WORLD), reduce_scatter_hook)
    else:
        model.register_comm_hook(LowPrecisionState(dist.group.WORLD, torch.bfloat16), bf16_compress_hook)
    return model


def wrap_with_allreduce_hook(model: nn.Module) -> nn.Module:
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy="NO_SHARD")
    model.register_comm_hook(DefaultState(), allreduce_hook)  # no group: the default group, as in torch
    return model


def wrap_fully_shard_with_hook(model: nn.Module) -> nn.Module:
    model = fully_shard_blocks(model)
    model.register_comm_hook(DefaultState(), reduce_scatter_hook)
    return model


@pytest.mark.parametrize(
    "shard",
    [functools.partial(wrap_with_hook, hook_name="default"), wrap_with_allreduce_hook, wrap_fully_shard_with_hook],
    ids=["reduce_scatter_hook", "allreduce_hook_no_shard", "fully_shard"],
)
def test_default_comm_hooks_parity(pool2: WorkerPool, reference: RunResult, shard: object) -> None:
    for got in pool2.run(_run, SPEC, shard):
        assert_parity(got, reference)


def _compressed(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = wrap_with_hook(TinyGPT(GPTConfig()), "bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(6):
        x, y = make_batch(model.cfg, 4, step % 2)
        COMM_STATS.reset()
        loss = model(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model_bytes = sum(p.numel() * 4 for p in TinyGPT(GPTConfig()).parameters())
    # Ranks of one host reduce point-to-point through shared memory at every size (engine/shm.py); elsewhere these
    # small reductions take gloo's own reduce-scatter, an all-reduce of the whole input: twice the bytes.
    pairwise = shm.channel(dist.group.WORLD, 4, torch.device("cpu")) is not None
    return {
        "losses": losses,
        "reduce_bytes": COMM_STATS.bytes["reduce_scatter"],
        "model_bytes": model_bytes,
        "wire_factor": 1 if pairwise else 2,
    }


def test_bf16_compression_hook_halves_reduce_bytes_and_trains(pool2: WorkerPool) -> None:
    got = pool2.run(_compressed)[0]
    # bf16: half of fp32's (N-1)/N share, twice on gloo's own reduce-scatter (an all-reduce of the whole input)
    assert got["reduce_bytes"] == pytest.approx(got["wire_factor"] * got["model_bytes"] / 2 / 2, rel=0.05)
    assert got["losses"][-1] < got["losses"][0]


def _hook_on_hybrid(rank: int, world: int) -> None:
    model = FSDP(
        nn.Linear(4, 4), sharding_strategy="HYBRID_SHARD", process_group=(dist.group.WORLD, dist.new_group([rank]))
    )
    model.register_comm_hook(DefaultState(), reduce_scatter_hook)


def test_comm_hook_refused_for_hybrid(pool2: WorkerPool) -> None:
    with pytest.raises(RankFailure, match=re.escape("register_comm_hook with sharding_strategy=HYBRID_SHARD")):
        pool2.run(_hook_on_hybrid)


# --- frozen parameters --------------------------------------------------------------------------------


class LoRA(nn.Module):
    """A frozen linear layer plus a small trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.up.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def lora_model() -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig())
    model.requires_grad_(False)
    for block in model.blocks:
        block.fc = LoRA(block.fc)
        block.attn = LoRA(block.attn)
    return model


def _lora(rank: int, world: int, entry: str) -> dict[str, object]:
    model = lora_model()
    if entry == "fsdp":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)
    else:
        model = fully_shard_blocks(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for step in range(3):
        x, y = make_batch(model.cfg if entry == "fsdp" else GPTConfig(), 8, step)
        loss = model(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4])
        loss.backward()
        grad_bytes = sum(
            (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).numel() * 4
            for p in model.parameters()
            if p.grad is not None
        )
        frozen_with_grad = sum(1 for p in model.parameters() if not p.requires_grad and p.grad is not None)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    with FSDP.summon_full_params(model, writeback=False):
        params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "grad_bytes": grad_bytes, "frozen_with_grad": frozen_with_grad, "params": params}


@pytest.mark.parametrize("entry", ["fsdp", "fully_shard"])
def test_lora_trains_with_parity_and_adapter_only_gradients(pool2: WorkerPool, entry: str) -> None:
    model = lora_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(3):
        x, y = make_batch(model.cfg, 8, step)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    adapter_bytes = sum(p.numel() * 4 for p in adapters.values())
    results = pool2.run(_lora, entry)
    for got in results:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), atol=1e-5, rtol=1e-5)
        assert got["frozen_with_grad"] == 0
        assert got["params"].keys() == adapters.keys()
        for name, ref in adapters.items():
            torch.testing.assert_close(got["params"][name], ref, atol=ATOL, rtol=RTOL, msg=name)
    # Per-rank gradient bytes are the adapters' shard, not the model's.
    assert sum(r["grad_bytes"] for r in results) == pytest.approx(adapter_bytes, rel=0.1)


# --- sharded gradient scaler --------------------------------------------------------------------------


def _scaler_skips_on_all_ranks(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = FSDP(TinyGPT(GPTConfig()), auto_wrap_policy=ModuleWrapPolicy({Block}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=1024.0)
    x, y = make_batch(model.cfg, 2, 0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(x, y)).backward()
    if rank == 1:  # an overflow on one rank only
        next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    scale_after_skip = scaler.get_scale()
    opt.zero_grad()
    scaler.scale(model(x, y)).backward()
    scaler.step(opt)
    scaler.update()
    changed = not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"skipped": unchanged, "scale": scale_after_skip, "stepped_next": changed}


def test_sharded_grad_scaler_skips_everywhere(pool2: WorkerPool) -> None:
    for got in pool2.run(_scaler_skips_on_all_ranks):
        assert got["skipped"] is True
        assert got["scale"] == 512.0
        assert got["stepped_next"] is True

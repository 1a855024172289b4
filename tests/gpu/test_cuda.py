"""The CUDA/NCCL paths: device placement, CPU offload with an accelerator, mixed precision on the GPU.

These run only where a GPU exists (this project's CI has none): one NCCL rank per GPU, as many ranks as
GPUs up to 2. With one GPU the shard group has one rank, which still exercises device placement, the
host-to-device copies of CPU offload and the casts; with two it exercises NCCL's collectives too.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from fullshard import FSDP, CPUOffload, MixedPrecisionPolicy
from fullshard.engine.unit_state import unit_state
from fullshard.testing import WorkerPool
from fullshard.testing.models import Block, GPTConfig, TinyGPT, make_batch
from fullshard.testing.parity import fully_shard_blocks
from fullshard.wrap import ModuleWrapPolicy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")

STEPS, BATCH = 3, 4


@pytest.fixture(scope="module")
def gpu_pool() -> Iterator[WorkerPool]:
    pool = WorkerPool(min(torch.cuda.device_count(), 2), backend="nccl")
    yield pool
    pool.close()


def _reference_losses() -> list[float]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = make_batch(model.cfg, BATCH, step)
        loss = model(x.cuda(), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train(rank: int, world: int, how: str) -> dict[str, object]:
    torch.manual_seed(0)
    model: nn.Module = TinyGPT(GPTConfig())
    seen: dict[str, object] = {}
    model.blocks[0].fc.register_forward_pre_hook(
        lambda m, a: seen.update(device=str(m.weight.device), dtype=m.weight.dtype)
    )
    if how == "fsdp":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=rank)
    elif how == "offload":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cuda", rank),
                     cpu_offload=CPUOffload(offload_params=True))  # fmt: skip
    else:
        model = fully_shard_blocks(model.cuda(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = BATCH // world
    losses = []
    for step in range(STEPS):
        x, y = make_batch(GPTConfig(), BATCH, step)
        x, y = x[rank * per : (rank + 1) * per].cuda(), y[rank * per : (rank + 1) * per].cuda()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    group = unit_state(model.blocks[0] if how == "bf16" else model.module.blocks[0]).group
    return {
        "losses": losses,
        "seen": seen,
        "params": {p.device.type for p in model.parameters()},
        "storage": group.storage_device.type,
        "shards": group.shard_group.shard_size,
    }


@pytest.mark.parametrize("how", ["fsdp", "offload"])
def test_cuda_training_matches_reference(gpu_pool: WorkerPool, how: str) -> None:
    want = _reference_losses()
    for got in gpu_pool.run(_train, how):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want), atol=1e-4, rtol=1e-4)
        assert got["seen"]["device"].startswith("cuda")
        expected = "cpu" if how == "offload" else "cuda"
        assert got["params"] == {expected} and got["storage"] == expected


def test_two_gpus_shard_each_unit_across_both(gpu_pool: WorkerPool) -> None:
    """With 2 GPUs the pool has 2 NCCL ranks: each unit is sharded across both, its collectives cross GPUs, and
    training still matches the single-process run."""
    if gpu_pool.world_size < 2:
        pytest.skip(f"needs 2 CUDA GPUs (one NCCL rank each); {torch.cuda.device_count()} visible")
    want = _reference_losses()
    for got in gpu_pool.run(_train, "fsdp"):
        assert got["shards"] == 2
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want), atol=1e-4, rtol=1e-4)


def test_bf16_compute_on_cuda(gpu_pool: WorkerPool) -> None:
    for got in gpu_pool.run(_train, "bf16"):
        assert got["seen"]["dtype"] == torch.bfloat16 and got["seen"]["device"].startswith("cuda")
        assert got["params"] == {"cuda"}
        assert got["losses"][-1] < got["losses"][0]


# --- async save from CUDA state: pinned host copies, the synchronous save's bytes ------------------------------


def _async_save_on_cuda(rank: int, world: int, root: str, version: int) -> dict[str, object]:
    from fullshard import Accelerator
    from fullshard.checkpoint import background
    from fullshard.frontend.saving import state_io
    from tests.distributed.test_accelerator import PER_RANK, dataset, model_and_optimizer, plugin

    state_io.release_save_buffers()
    accelerator = Accelerator(fsdp_plugin=plugin(version))
    model, optimizer, scheduler = accelerator.prepare(*model_and_optimizer(0))
    for i in range(2):
        x, y = (t.to(accelerator.device) for t in dataset()[i * PER_RANK : (i + 1) * PER_RANK])
        accelerator.backward(model(x, y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    devices = {p.device.type for p in model.parameters()}
    accelerator.save_state(f"{root}/sync")
    accelerator.save_state(f"{root}/async", async_save=True)
    state_io.wait_for_save()
    kept = list(background.buffers().tensors.values())
    # AdamW's step counts stay on the CPU (not capturable): only they may be left unpinned
    out = {"devices": devices, "pinned": [t.numel() for t in kept if t.is_pinned()],
           "unpinned": [tuple(t.shape) for t in kept if not t.is_pinned()]}  # fmt: skip
    state_io.release_save_buffers()
    return out


@pytest.mark.parametrize("version", [1, 2])
def test_async_save_of_cuda_state_copies_to_pinned_memory_and_writes_the_sync_bytes(
    gpu_pool: WorkerPool, tmp_path, version: int
) -> None:
    from tests.distributed.test_checkpoint_async import _assert_same_files

    for got in gpu_pool.run(_async_save_on_cuda, str(tmp_path), version):
        assert got["devices"] == {"cuda"}
        assert len(got["pinned"]) > 0 and all(shape == () for shape in got["unpinned"]), got
    _assert_same_files(tmp_path / "sync", tmp_path / "async", 3)


def _mixed_dtype_unit(rank: int, world: int, entry: str) -> dict[str, object]:
    """``tests/distributed/test_mixed_dtype_units.py``'s frozen bf16 base + fp32 adapters in one unit, on the GPU:
    fullshard's ``fully_shard`` or torch's, a bf16 compute policy reducing in fp32, 3 AdamW steps."""
    from tests.distributed.test_mixed_dtype_units import STEPS as MIXED_STEPS
    from tests.distributed.test_mixed_dtype_units import Net, _batch, _loss

    model = Net().cuda()
    if entry == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as shard
    else:
        from fullshard import fully_shard as shard

        TorchPolicy = MixedPrecisionPolicy  # noqa: N806
    policy = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        shard(block, mp_policy=policy)
    shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    per, losses = 8 // world, []
    for step in range(MIXED_STEPS):
        loss = _loss(model(_batch(step)[rank * per : (rank + 1) * per].cuda()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    state = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    return {
        "losses": losses,
        "state": state,
        "local_base_dtypes": {p.to_local().dtype for n, p in model.named_parameters() if "base" in n},
        "devices": {p.device.type for p in model.parameters()},
    }


def test_mixed_dtype_unit_on_cuda_matches_torch_fully_shard(gpu_pool: WorkerPool) -> None:
    """A unit holding bf16 and fp32 parameters (LoRA on a bf16 base), its one byte buffer gathered on the GPU."""
    ours = gpu_pool.run(_mixed_dtype_unit, "fullshard")[0]
    theirs = gpu_pool.run(_mixed_dtype_unit, "torch")[0]
    assert ours["devices"] == {"cuda"} and ours["local_base_dtypes"] == {torch.bfloat16}
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
    for key, value in theirs["state"].items():
        assert ours["state"][key].dtype == value.dtype, key
        torch.testing.assert_close(ours["state"][key], value, atol=1e-5, rtol=0, msg=key)

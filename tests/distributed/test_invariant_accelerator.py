"""World-size-invariant mode through the Accelerator (issue 27 §1): an ordinary Accelerate loop (``prepare``,
``accumulate``, ``backward``, ``clip_grad_norm_``, ``step``, a scheduler) with dropout gives ``torch.equal`` weights
and clipping norms on 1, 2 and 4 ranks; see [Note: invariant training through the Accelerator] in
``frontend/invariant.py``.

Set up: a small model with dropout after every hidden layer (odd widths; its largest weight spans several norm
pieces), a shuffled map-style dataset whose size leaves the last global batch incomplete (completed from the
epoch's start, ``even_batches``), two epochs.
Run: each case on 1, 2 and 4 ranks (every case of one world size in one pool call; 1 rank is a pool of its own).
Check: the weights, the norms, the learning rates, and ``gather_for_metrics`` of the sample ids (each epoch's
samples exactly once: the padding dropped) are the same on every world size; plus a ``transformers`` GPT-2 with
dropout on 1 vs 2 ranks, and the refusals.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fullshard import Accelerator, DataLoaderConfiguration, FullyShardedDataParallelPlugin, ParallelismConfig
from fullshard.testing import RankFailure, WorkerPool
from fullshard.utils import set_seed

IN, WIDTH, CLASSES = 13, 40, 5
MICRO, SAMPLES, EPOCHS, MAX_NORM = 3, 29, 2, 0.05  # G=4: 12 samples per global batch, 3 global batches an epoch

# (name, fsdp_version, strategy, G, split_batches)
CASES = [
    ("fsdp1-full-G4", 1, "FULL_SHARD", 4, False),
    ("fsdp1-grad-op-G4", 1, "SHARD_GRAD_OP", 4, False),
    ("fsdp2-hsdp-G4", 2, "HSDP", 4, False),  # 4 ranks: ParallelismConfig (replicate 2, shard 2); 1, 2: no config
    ("fsdp2-G4", 2, "FULL_SHARD", 4, False),
    ("fsdp2-G8-split", 2, "SHARD_GRAD_OP", 8, True),  # batch_size is the global batch: 8 micro-batches of 3
    ("fsdp1-full-G4-bf16", 1, "FULL_SHARD", 4, False),  # names ending in -bf16: Accelerator(mixed_precision="bf16")
    ("fsdp2-G4-bf16", 2, "FULL_SHARD", 4, False),
]


class DropBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 2 * WIDTH + 1)
        self.drop = nn.Dropout(0.25)
        self.out = nn.Linear(2 * WIDTH + 1, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.drop(F.gelu(self.fc(x))))


class DropNet(nn.Module):
    _no_split_modules = ("DropBlock",)

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, WIDTH)
        self.blocks = nn.ModuleList(DropBlock() for _ in range(2))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(self.drop(h)), y)


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(SAMPLES, IN, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g), torch.arange(SAMPLES)
    )


def _plugin(version: int, strategy: str, micro_batches: int | None, **kw: Any) -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(
        fsdp_version=version,
        reshard_after_forward=strategy,
        auto_wrap_policy="transformer_based_wrap",
        invariant_micro_batches=micro_batches,
        **kw,
    )


def train_cases(rank: int, world: int, cases: list[tuple[str, int, str, int, bool]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, version, strategy, micro_batches, split in cases:
        hsdp = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2) if strategy == "HSDP" and world == 4 else None
        accelerator = Accelerator(
            fsdp_plugin=_plugin(version, "FULL_SHARD" if strategy == "HSDP" else strategy, micro_batches),
            dataloader_config=DataLoaderConfiguration(split_batches=split),
            parallelism_config=hsdp,
            mixed_precision="bf16" if name.endswith("-bf16") else "no",
        )
        set_seed(0)
        model = DropNet()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        loader = DataLoader(_dataset(), batch_size=MICRO * micro_batches if split else MICRO, shuffle=True)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        norms, lrs, seen = [], [], []
        for _ in range(EPOCHS):
            ids: list[torch.Tensor] = []
            for x, y, index in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(model(x, y))
                    if accelerator.sync_gradients:
                        norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM))
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                ids.append(accelerator.gather_for_metrics(index))
            seen.append(torch.cat(ids))
            lrs.append(scheduler.get_last_lr()[0])
        results[name] = {
            "params": accelerator.get_state_dict(model),
            "norms": norms,
            "lrs": lrs,
            "seen": seen,
            "accumulation": accelerator.gradient_accumulation_steps,
            "mesh": getattr(getattr(next(model.parameters()), "device_mesh", None), "shape", None),
        }
    return results


@pytest.fixture(scope="module")
def runs(pool1: WorkerPool, pool2: WorkerPool, pool4: WorkerPool) -> dict[int, dict[str, Any]]:
    """Rank 0's results per world size (``get_state_dict`` gives the full weights on rank 0 only)."""
    return {n: pool.run(train_cases, CASES)[0] for n, pool in ((1, pool1), (2, pool2), (4, pool4))}


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_weights_bitwise_equal_on_1_2_4_ranks(runs: dict[int, dict[str, Any]], case: str) -> None:
    want = runs[1][case]
    micro_batches = next(c[3] for c in CASES if c[0] == case)
    steps = EPOCHS * -(-SAMPLES // (MICRO * micro_batches))
    assert len(want["norms"]) == steps and all(float(n) > MAX_NORM for n in want["norms"])  # clipping was active
    assert want["lrs"][-1] < 1e-2  # the scheduler stepped once per optimizer step, on every N
    for world, results in runs.items():
        got = results[case]
        assert got["accumulation"] == micro_batches // world
        if case == "fsdp2-hsdp-G4" and world == 4:
            assert got["mesh"] == (2, 2)  # hybrid: replicated over 2, sharded over 2
        assert got["params"].keys() == want["params"].keys()
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), f"{case}: {world} ranks: {name} differs"
        for a, b in zip(got["norms"], want["norms"], strict=True):
            assert torch.equal(a, b), f"{case}: {world} ranks: norm {a} != {b}"
        assert got["lrs"] == want["lrs"]
        for epoch, ids in enumerate(got["seen"]):  # each sample once (the padding dropped), the same on every N
            assert sorted(ids.tolist()) == list(range(SAMPLES)), f"{case}: {world} ranks, epoch {epoch}"
            assert sorted(ids.tolist()) == sorted(want["seen"][epoch].tolist())


def test_dropout_makes_a_difference(runs: dict[int, dict[str, Any]], pool1: WorkerPool) -> None:
    """Without the per-micro-batch seeds the masks would follow the rank: check the masks do matter at all."""
    got = pool1.run(train_without_dropout)[0]
    want = runs[1]["fsdp2-G4"]["params"]
    assert any(not torch.equal(got[name], want[name]) for name in want)


def train_without_dropout(rank: int, world: int) -> dict[str, torch.Tensor]:
    accelerator = Accelerator(fsdp_plugin=_plugin(2, "FULL_SHARD", 4))
    set_seed(0)
    model = DropNet()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_dataset(), batch_size=MICRO, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y, _ in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(x, y))
            optimizer.step()
            optimizer.zero_grad()
    return accelerator.get_state_dict(model)


# --- a transformers model ------------------------------------------------------------------------------------


def train_gpt2(rank: int, world: int) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    accelerator = Accelerator(fsdp_plugin=_plugin(2, "FULL_SHARD", 4))
    set_seed(0)
    config = GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1)  # fmt: skip
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, config.vocab_size, (20, 12), generator=torch.Generator().manual_seed(3))
    loader = DataLoader(TensorDataset(tokens), batch_size=2, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    norms = []
    for (ids,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5))
            optimizer.step()
            optimizer.zero_grad()
    return {"params": accelerator.get_state_dict(model), "norms": norms}


def test_transformers_gpt2_with_dropout_on_1_and_2_ranks(pool1: WorkerPool, pool2: WorkerPool) -> None:
    pytest.importorskip("transformers")
    want, got = pool1.run(train_gpt2)[0], pool2.run(train_gpt2)[0]
    assert len(want["norms"]) == 3  # 20 samples in global batches of 8: 3 steps, the last completed
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), name
    assert all(torch.equal(a, b) for a, b in zip(got["norms"], want["norms"], strict=True))


# --- refusals --------------------------------------------------------------------------------------------------


def _misuse(rank: int, world: int, what: str) -> None:
    """2 ranks."""
    micro_batches = 1 if what == "G below N" else 4
    accumulation = 3 if what == "accumulation" else 1
    config = DataLoaderConfiguration(split_batches=what == "split", even_batches=what != "uneven")
    accelerator = Accelerator(
        fsdp_plugin=_plugin(2, "FULL_SHARD", micro_batches),
        gradient_accumulation_steps=accumulation,
        dataloader_config=config,
    )
    model, loader = accelerator.prepare(DropNet(), DataLoader(_dataset(), batch_size=6))
    x, y, _ = next(iter(loader))
    accelerator.backward(model(x, y))  # outside accumulate()


@pytest.mark.parametrize(
    "what, message",
    [
        ("G below N", "invariant_micro_batches=1 is not a multiple of the data-parallel size 2"),
        ("accumulation", r"gradient_accumulation_steps=3\) with invariant_micro_batches=4 on 2 data-parallel ranks"),
        ("split", r"batch_size \(6\) is the global batch, cut into 4 micro-batches"),
        ("uneven", "even_batches=False and invariant_micro_batches=4"),
        ("outside accumulate", r"Accelerator.backward outside accumulate\(\) in world-size-invariant mode"),
    ],
)
def test_misuse_is_refused(pool2: WorkerPool, what: str, message: str) -> None:
    with pytest.raises(RankFailure, match=message):
        pool2.run(_misuse, what)

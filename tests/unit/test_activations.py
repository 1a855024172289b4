"""The meta-device activation profile counts what a real CPU forward saves for backward, byte for byte."""

from __future__ import annotations

import torch
from torch import nn

from fullshard.cli.activations import profile_activations
from fullshard.testing.models import GPTConfig, TinyGPT

CFG = GPTConfig(vocab_size=97, block_size=64, n_layer=3, n_head=4, n_embd=32)


def _saved_on_cpu(model: nn.Module, batch: int) -> int:
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, CFG.vocab_size, (batch, CFG.block_size))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, ids)
    return sum(seen.values())


def test_meta_profile_equals_a_real_forward() -> None:
    torch.manual_seed(0)
    real = TinyGPT(CFG)
    with torch.device("meta"):
        meta = TinyGPT(CFG)
    profile = profile_activations(meta, list(meta.blocks), 3, CFG.block_size, CFG.vocab_size)
    assert sum(profile.per_unit) + profile.root == _saved_on_cpu(real, 3)
    assert len(profile.per_unit) == 3 and len(set(profile.per_unit)) == 1  # identical blocks save alike
    assert profile.unit_inputs[0] == 3 * CFG.block_size * CFG.n_embd * 4


def test_checkpointing_keeps_unit_inputs_and_one_unit() -> None:
    with torch.device("meta"):
        meta = TinyGPT(CFG)
    p = profile_activations(meta, list(meta.blocks), 2, CFG.block_size, CFG.vocab_size)
    assert p.peak(False) - p.peak(True) == sum(p.per_unit) - sum(p.unit_inputs) - max(p.per_unit)
    assert p.output >= 2 * CFG.block_size * CFG.vocab_size * 4  # the logits' gradient at backward's start

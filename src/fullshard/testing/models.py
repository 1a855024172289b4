"""Tiny models for tests and examples: a GPT-style transformer whose parameter sizes divide unevenly, and a
two-layer ``transformers`` Llama built from a config (no download)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "GPTConfig", "TinyGPT", "gpt", "make_batch", "tiny_llama"]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of :class:`TinyGPT`; the defaults are odd on purpose so that no dim 0 divides 2 or 4."""

    vocab_size: int = 37
    block_size: int = 11
    n_layer: int = 2
    n_head: int = 3
    n_embd: int = 15
    tie_weights: bool = False


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)  # a key bias only adds rounding noise
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd + 1)
        self.fc_out = nn.Linear(4 * cfg.n_embd + 1, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, a final norm and a language-model head."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or GPTConfig()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # One element: smaller than any world size, so some ranks hold none of it.
        self.logit_scale = nn.Parameter(torch.ones(1))
        if cfg.tie_weights:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)) * self.logit_scale
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt(**sizes: int | bool) -> TinyGPT:
    """A :class:`TinyGPT` with the :class:`GPTConfig` fields ``sizes``, whose blocks are its units by default.

    The factory behind ``fullshard estimate-memory fullshard.testing.models:gpt --model-arg n_layer=16 ...``;
    ``_no_split_modules`` names ``Block`` on this instance only, as Hugging Face models do on their class.
    """
    unknown = sorted(set(sizes) - set(GPTConfig.__dataclass_fields__))
    if unknown:
        fields = list(GPTConfig.__dataclass_fields__)
        raise TypeError(f"gpt(): unknown GPTConfig fields {unknown}; the fields are {fields}")
    model = TinyGPT(GPTConfig(**sizes))  # type: ignore[arg-type]
    model._no_split_modules = ["Block"]
    return model


def make_batch(cfg: GPTConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic random batch of token ids and next-token targets."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def tiny_llama() -> nn.Module:
    """A ``LlamaForCausalLM`` of 2 layers, hidden size 32 and a vocabulary of 64, initialised from seed 0: the same
    weights on every rank and in every call. Needs ``transformers`` (imported here, not with this module)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)

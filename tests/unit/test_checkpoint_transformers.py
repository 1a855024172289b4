"""fullshard's activation checkpointing on a Hugging Face decoder layer behaves as transformers' own
``gradient_checkpointing_enable()``: the same gradients as no checkpointing, and no KV cache written (a wrapped
layer wrote the cache twice, in forward and in the recomputation, and kept it alive through backward)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fullshard import apply_activation_checkpointing, checkpoint_module

transformers = pytest.importorskip("transformers")

TOKENS = 16


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, TOKENS), generator=torch.Generator().manual_seed(1))


def _step(model: nn.Module) -> tuple[Any, list[torch.Tensor]]:
    """One forward (``use_cache`` left to the config's default, true) and backward; the cache and the gradients."""
    out = model(input_ids=_ids(), labels=_ids())
    out.loss.backward()
    return out.past_key_values, [p.grad for p in model.parameters()]


def _cached_positions(cache: Any) -> int:
    return 0 if cache is None else cache.get_seq_length()


def test_checkpointed_llama_layers_match_transformers_own_checkpointing() -> None:
    plain_cache, plain = _step(_llama())
    assert _cached_positions(plain_cache) == TOKENS  # the default: a cache is built and filled once

    theirs_model = _llama()
    theirs_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    theirs_cache, theirs = _step(theirs_model)

    ours_model = _llama()
    layer_cls = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    assert apply_activation_checkpointing(ours_model, lambda m: isinstance(m, layer_cls)) == 2
    ours_cache, ours = _step(ours_model)

    # a wrapped layer wrote the cache twice (32 positions for 16 tokens); transformers' switch writes none
    assert _cached_positions(ours_cache) == _cached_positions(theirs_cache) == 0
    for name, a, b, c in zip([n for n, _ in ours_model.named_parameters()], plain, theirs, ours, strict=True):
        assert torch.equal(a, c), name  # the recomputation repeats the same kernels on the same inputs
        assert torch.equal(b, c), name


def test_checkpointed_layers_recompute_in_training_only() -> None:
    """As under transformers' switch: in eval mode a checkpointed layer runs as is, so generation keeps its cache."""
    model = _llama()
    for layer in model.model.layers:
        assert checkpoint_module(checkpoint_module(layer)) is layer  # idempotent
    model.eval()
    with torch.no_grad():
        out = model(input_ids=_ids())
    assert _cached_positions(out.past_key_values) == TOKENS

    # in training, what the layers save for backward goes to the checkpoint (recomputed), not to autograd's graph
    assert _saved_in_forward(model.train()) < _saved_in_forward(_llama()) / 2


def _saved_in_forward(model: nn.Module) -> int:
    """How many tensors autograd's graph keeps from one forward (checkpointed regions pack theirs themselves)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        loss = model(input_ids=_ids(), labels=_ids()).loss
    loss.backward()
    return len(saved)


def test_a_layer_transformers_checkpoints_already_is_left_as_it_is() -> None:
    """After ``gradient_checkpointing_enable()``, checkpointing again keeps the user's function: one recomputation;
    after ``gradient_checkpointing_disable()`` it switches the layer on again."""
    unchecked = _saved_in_forward(_llama())
    model = _llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    functions = [layer._gradient_checkpointing_func for layer in model.model.layers]
    for layer in model.model.layers:
        checkpoint_module(layer)
    assert [layer._gradient_checkpointing_func for layer in model.model.layers] == functions
    assert _saved_in_forward(model) < unchecked / 2

    model.gradient_checkpointing_disable()  # transformers' switch is the only state: switched off, then on again
    assert _saved_in_forward(model) == unchecked
    for layer in model.model.layers:
        checkpoint_module(layer)
    assert _saved_in_forward(model) < unchecked / 2

"""Activation memory of one training step, measured on the meta device (nothing is allocated).

The model runs one forward on ``meta`` inputs of the given batch and sequence length under
``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd keeps for backward is counted once (by its
storage), except the parameters (the gathered units are counted apart, in ``memory_estimate.py``). Forward hooks on
the unit modules attribute what is saved while each unit runs to that unit; the rest (embeddings, the head,
the loss) belongs to the root.

What a step holds at its peak, the end of forward / start of backward:
- without activation checkpointing: everything saved, plus the logits' gradient (as large as the logits);
- with activation checkpointing of every unit: each unit keeps only its input, the root keeps what it saves,
  and backward recomputes one unit at a time, so the largest unit's saved bytes come back once.

On ``meta`` tensors ``scaled_dot_product_attention`` takes its math path, which keeps the whole
(batch, heads, seq, seq) attention matrix; on real devices (CPU and GPU alike) it takes a fused kernel that
keeps only the output and a log-sum-exp per row. The profile therefore routes unmasked attention to the CPU's
fused kernel (``_scaled_dot_product_flash_attention_for_cpu``, which has a meta implementation), so that it
counts what a real run keeps.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["ActivationProfile", "profile_activations"]


@dataclass(frozen=True)
class ActivationProfile:
    """Bytes autograd saves in one forward of ``batch`` sequences of ``seq`` tokens (see the module docstring)."""

    per_unit: tuple[int, ...]  # saved while each unit ran, in forward order
    unit_inputs: tuple[int, ...]  # each unit's input (what checkpointing keeps)
    root: int  # saved outside the units
    output: int  # the forward's output (loss or logits) and the logits, alive into backward

    def peak(self, checkpointing: bool) -> int:
        if not checkpointing:
            return sum(self.per_unit) + self.root + self.output
        return sum(self.unit_inputs) + self.root + self.output + max(self.per_unit, default=0)


class _FusedAttention(TorchFunctionMode):
    """Meta-device attention as the fused kernels save it (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].is_meta:
            q, k, v = args[:3]
            rest = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale"), args[3:], strict=False), **kwargs)
            if rest.get("attn_mask") is None and not rest.get("enable_gqa") and q.shape[-3] == k.shape[-3]:
                fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
                return fused(
                    q, k, v, rest.get("dropout_p", 0.0), rest.get("is_causal", False), scale=rest.get("scale")
                )[0]
        return func(*args, **kwargs)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _call(model: nn.Module, ids: torch.Tensor) -> object:
    names = list(inspect.signature(model.forward).parameters)
    if "labels" in names:
        return model(input_ids=ids, labels=ids)
    if len(names) >= 2 and names[1] in ("targets", "target", "labels"):
        return model(ids, ids)
    return model(ids)


def profile_activations(
    model: nn.Module, unit_modules: list[nn.Module], batch: int, seq: int, vocab: int | None = None
) -> ActivationProfile:
    """Run ``model`` once on meta token ids of shape ``(batch, seq)`` and count what autograd saves."""
    if batch < 1 or seq < 1:
        raise ValueError(f"batch={batch}, seq={seq}: both must be at least 1 to estimate activations.")
    model = model.to("meta") if any(not p.is_meta for p in model.parameters()) else model
    param_keys = {_storage_key(p) for p in model.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in param_keys and key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    per_unit: list[int] = []
    inputs: list[int] = []
    starts: dict[int, int] = {}

    def pre(module: nn.Module, args: tuple) -> None:
        starts[id(module)] = total[0]
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        inputs.append(0 if first is None else first.numel() * first.element_size())

    def post(module: nn.Module, args: tuple, output: object) -> None:
        per_unit.append(total[0] - starts.pop(id(module)))

    handles = [m.register_forward_pre_hook(pre) for m in unit_modules]
    handles += [m.register_forward_hook(post) for m in unit_modules]
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _FusedAttention():
            out = _call(model, ids)
    finally:
        for h in handles:
            h.remove()
    logits = getattr(out, "logits", None)
    out_tensor = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else out
    output = sum(t.numel() * t.element_size() for t in (out_tensor, logits) if isinstance(t, torch.Tensor))
    if vocab and out_tensor is not None and out_tensor.dim() == 0:
        output += batch * seq * vocab * 4  # the loss's gradient w.r.t. the logits, born at backward's start
    return ActivationProfile(tuple(per_unit), tuple(inputs), total[0] - sum(per_unit), output)

"""A Hugging Face model's output keeps its type through every mixed-precision setting and entry point.

Set up: a tiny ``LlamaForCausalLM`` built from a config (no download), on 2 gloo ranks.
Run / Check: under ``Accelerator(mixed_precision="bf16")`` with ``fsdp_version`` 1 and 2, and under the engine's
own entry points with a bf16 policy, ``model(input_ids, labels=...)`` returns the model's ``ModelOutput`` class
(so ``outputs.loss`` and ``outputs["logits"]`` work), in the dtype Accelerate leaves (FSDP1: float32 through its
output conversion; FSDP2: the policy's ``output_dtype``), and the loss equals a single-process forward of the
same weights in bf16 on the same rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fullshard.testing import WorkerPool
from fullshard.testing.models import tiny_llama

transformers = pytest.importorskip("transformers")


def _batch(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, 64, (2, 12), generator=generator)


def _reference_loss(rank: int) -> float:
    model = tiny_llama().to(torch.bfloat16)
    ids = _batch(rank)
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.float().item()


def forward_through(rank: int, world: int, entry: str) -> dict[str, Any]:
    from fullshard import (
        Accelerator,
        FullyShardedDataParallel,
        FullyShardedDataParallelPlugin,
        MixedPrecision,
        MixedPrecisionPolicy,
        fully_shard,
    )

    model = tiny_llama()
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    if entry.startswith("accelerator"):
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=int(entry[-1]),
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        )
        accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16")
        model = accelerator.prepare(model)
    elif entry == "FSDP":
        from fullshard.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({layer}), mixed_precision=MixedPrecision(torch.bfloat16)
        )
    else:
        for block in model.model.layers:
            fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    ids = _batch(rank)
    outputs = model(input_ids=ids, labels=ids)
    outputs.loss.backward()
    return {
        "type": type(outputs).__name__,
        "keys": list(outputs.keys()),
        "loss": outputs.loss.float().item(),
        "loss_dtype": outputs.loss.dtype,
        "logits_dtype": outputs["logits"].dtype,
        "same_logits": outputs.logits is outputs["logits"] and outputs[1] is outputs.logits,
        "reference": _reference_loss(rank),
    }


@pytest.mark.parametrize(
    ("entry", "loss_dtype", "logits_dtype"),
    [
        ("accelerator_v1", torch.float32, torch.float32),  # Accelerate converts FSDP1 outputs to float32
        ("accelerator_v2", torch.bfloat16, torch.bfloat16),  # FSDP2: the policy's output_dtype, bf16 as Accelerate
        ("FSDP", torch.float32, torch.bfloat16),  # nothing cast on the way out; Llama's loss upcasts the logits
        ("fully_shard", torch.float32, torch.float32),  # the root's output_dtype=float32
    ],
)
def test_model_output_keeps_its_type_under_bf16(
    pool2: WorkerPool, entry: str, loss_dtype: torch.dtype, logits_dtype: torch.dtype
) -> None:
    for result in pool2.run(forward_through, entry):
        assert result["type"] == "CausalLMOutputWithPast"
        assert result["keys"][:2] == ["loss", "logits"]
        assert result["same_logits"]
        assert (result["loss_dtype"], result["logits_dtype"]) == (loss_dtype, logits_dtype)
        assert result["loss"] == pytest.approx(result["reference"], abs=2e-2)

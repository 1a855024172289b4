"""``Accelerator(dynamo_backend=...)`` / ``TorchDynamoPlugin`` compile the prepared model, as Accelerate does.

Set up: TinyGPT through the Accelerator on 2 gloo ranks, 3 AdamW steps, compiled with ``aot_eager`` (dynamo
and AOT autograd without generating kernels, so seconds on a CPU, and the same aten ops as eager).
Check: for both ``fsdp_version``s the model is compiled (before, the argument was accepted and ignored) and its
losses and final weights equal the eager Accelerator run's bitwise; regional compilation compiles the repeated
blocks' code once whatever their number; ``ACCELERATE_DYNAMO_*`` fill the unset fields; bad values and
``device_placement=False`` are refused by name.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch

from fullshard import Accelerator, FullyShardedDataParallelPlugin
from fullshard.testing import WorkerPool
from fullshard.testing.models import gpt
from fullshard.testing.parity import TrainSpec
from fullshard.utils import DynamoBackend, TorchDynamoPlugin

SPEC = TrainSpec(optimizer="adamw", steps=3)


def train(rank: int, world: int, version: int, dynamo: dict[str, Any] | None, n_layer: int = 2) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=version, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
    )
    kwargs = {} if dynamo is None else {"dynamo_plugin": TorchDynamoPlugin(**dynamo)}
    accelerator = Accelerator(fsdp_plugin=plugin, **kwargs)
    torch.manual_seed(0)
    model = gpt(n_layer=n_layer)
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=SPEC.lr))
    per = SPEC.batch // world
    losses = []
    for step in range(SPEC.steps):
        ((x, y),) = SPEC.micro_batches(step)
        loss = model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    compiled = sorted(n or "<root>" for n, m in model.named_modules() if m._compiled_call_impl is not None)
    return {
        "losses": torch.stack(losses),
        "weights": accelerator.get_state_dict(model),
        "compiled": compiled,
        "graphs": counters["stats"]["unique_graphs"],
    }


@pytest.mark.parametrize("version", [1, 2])
def test_dynamo_backend_compiles_and_trains_like_eager(pool2: WorkerPool, version: int) -> None:
    compiled = pool2.run(train, version, {"backend": "aot_eager"})
    eager = pool2.run(train, version, None)
    for got, want in zip(compiled, eager):
        assert got["compiled"] == ["<root>"] and got["graphs"] > 0
        assert want["compiled"] == [] and want["graphs"] == 0
        assert torch.equal(got["losses"], want["losses"])
        if got["weights"]:  # the full state dict is on rank 0
            assert all(torch.equal(got["weights"][k], v) for k, v in want["weights"].items())


def test_regional_compilation_compiles_each_block_once(pool2: WorkerPool) -> None:
    dynamo = {"backend": "aot_eager", "use_regional_compilation": True}
    two = pool2.run(train, 2, dynamo, 2)[0]
    four = pool2.run(train, 2, dynamo, 4)[0]
    assert "blocks.0" in two["compiled"] and "blocks.3" in four["compiled"] and "<root>" not in four["compiled"]
    assert four["graphs"] == two["graphs"]  # twice the blocks, no more graphs: the block's code is reused


def test_the_plugin_reads_the_launchers_variables() -> None:
    variables = {
        "ACCELERATE_DYNAMO_BACKEND": "aot_eager",
        "ACCELERATE_DYNAMO_MODE": "max-autotune",
        "ACCELERATE_DYNAMO_USE_FULLGRAPH": "true",
        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "1",
    }
    with mock.patch.dict("os.environ", variables):
        plugin = TorchDynamoPlugin()
        explicit = TorchDynamoPlugin(backend="inductor", fullgraph=False)
    assert plugin.backend is DynamoBackend.AOT_EAGER and plugin.mode == "max-autotune"
    assert plugin.fullgraph and plugin.use_regional_compilation and plugin.dynamic is None
    assert plugin.to_kwargs() == {"backend": "aot_eager", "mode": "max-autotune", "fullgraph": True}
    assert explicit.backend is DynamoBackend.INDUCTOR and explicit.fullgraph is False
    with mock.patch.dict("os.environ", {}, clear=True):
        assert not TorchDynamoPlugin().enabled


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dynamo_plugin": TorchDynamoPlugin(backend="eager"), "dynamo_backend": "eager"}, "pass one of them"),
        ({"dynamo_backend": "inductr"}, r"backend='inductr'.*not a torch.compile backend"),
        ({"device_placement": False}, r"device_placement=False\).*always places"),
        ({"dynamo_mode": "x"}, r"Accelerator\(dynamo_mode=...\): not an argument"),
    ],
)
def test_bad_compile_arguments_are_refused_by_name(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        Accelerator(**kwargs)

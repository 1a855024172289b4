"""LoRA through PEFT on a sharded Llama: the adapters train as in one process, and every way of saving them
writes an adapter that loads back into a fresh base with the trained model's logits.

Set up: a tiny ``LlamaForCausalLM`` from a config (no download), ``get_peft_model`` with LoRA on ``q_proj`` and
``v_proj`` (A gaussian, B zero: A moves from the second step on); 2 gloo ranks, each its own batch.
Run: ``Accelerator`` with ``fsdp_version=1`` (``use_orig_params`` True and False) and ``fsdp_version=2``, two
SGD steps over the trainable parameters; then ``unwrap_model(model).save_pretrained(d, state_dict=
accelerator.get_state_dict(model))`` and ``save_pretrained(d)`` without ``state_dict=``, on every rank.
Check: only adapters have gradients, and gradients and optimizer state hold the adapters' shards' bytes only;
the adapters after two steps (SGD with momentum) equal a single-process PEFT run on both ranks' rows (fp32
tolerance: the reduction order differs); each saved file holds every adapter tensor, and
``PeftModel.from_pretrained`` on a fresh base gives the reference model's logits; ``save_state`` merged by
``merge_fsdp_weights`` loads into a fresh PEFT model whose ``merge_and_unload()`` gives them too.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from fullshard.testing import WorkerPool
from fullshard.testing.models import tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ROUTES = ("state_dict", "plain")


def _lora() -> Any:
    base = tiny_llama()
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    return peft.get_peft_model(base, config)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))


def _probe() -> torch.Tensor:
    return torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(7))


def _adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items() if "lora_" in k}


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _reference(world: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = _lora()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for step in range(2):
        ids = torch.cat([_batch(rank, step) for rank in range(world)])
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        return _adapters(model.state_dict()), model(input_ids=_probe()).logits


def train_and_save(rank: int, world: int, version: int, use_orig_params: bool, folder: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    from fullshard import Accelerator, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, use_orig_params=use_orig_params,
                                            state_dict_type="SHARDED_STATE_DICT",
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])  # fmt: skip
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = accelerator.prepare(_lora())
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = accelerator.prepare(torch.optim.SGD(trainable, lr=0.1, momentum=0.9))
    with_grads: set[str] = set()
    for step in range(2):
        ids = _batch(rank, step)
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        with_grads |= {n for n, p in model.named_parameters() if p.grad is not None}
        grad_bytes = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad()
    state_bytes = sum(_local_bytes(t) for s in optimizer.optimizer.state.values() for t in s.values())
    state = accelerator.get_state_dict(model)
    accelerator.save_state(os.path.join(folder, f"state_v{version}_{use_orig_params}"))
    unwrapped = accelerator.unwrap_model(model)
    saved = {}
    for route in ROUTES:
        where = os.path.join(folder, f"v{version}_{use_orig_params}_{route}")
        if route == "state_dict":
            unwrapped.save_pretrained(where, state_dict=state, is_main_process=accelerator.is_main_process)
        else:
            unwrapped.save_pretrained(where, is_main_process=accelerator.is_main_process)
        accelerator.wait_for_everyone()
        if rank == 0:
            tensors = load_file(os.path.join(where, "adapter_model.safetensors"))
            loaded = peft.PeftModel.from_pretrained(tiny_llama(), where)
            with torch.no_grad():
                saved[route] = (sorted(tensors), loaded(input_ids=_probe()).logits)
    adapter_bytes = sum(_local_bytes(p) for p in trainable)
    return {"with_grads": with_grads, "adapters": _adapters(state) if rank == 0 else None, "saved": saved,
            "bytes": (grad_bytes, state_bytes, adapter_bytes)}  # fmt: skip


@pytest.mark.parametrize(("version", "use_orig_params"), [(1, True), (1, False), (2, True)])
def test_lora_trains_as_one_process_and_saves_by_every_route(
    pool2: WorkerPool, tmp_path: Any, version: int, use_orig_params: bool
) -> None:
    results = pool2.run(train_and_save, version, use_orig_params, str(tmp_path))
    adapters, logits = _reference(2)
    expected_files = sorted(k.replace(".default", "") for k in adapters)
    assert len(expected_files) == 8
    for result in results:
        assert result["with_grads"] and all("lora_" in name for name in result["with_grads"])
        grad_bytes, state_bytes, adapter_bytes = result["bytes"]
        # frozen weights cost no gradient and no optimizer state: both are the adapters' shards only
        assert grad_bytes == state_bytes == adapter_bytes > 0
    trained = results[0]["adapters"]
    assert trained.keys() == adapters.keys()
    for key, value in adapters.items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6, msg=key)
    for route in ROUTES:
        names, loaded_logits = results[0]["saved"][route]
        assert names == expected_files, route
        torch.testing.assert_close(loaded_logits, logits, rtol=1e-5, atol=1e-5, msg=route)
    # the whole-model checkpoint, merged by merge-weights, loads into a fresh PEFT model; then merge_and_unload
    from safetensors.torch import load_file

    from fullshard.utils import merge_fsdp_weights

    checkpoint = tmp_path / f"state_v{version}_{use_orig_params}" / "pytorch_model_fsdp_0"
    merge_fsdp_weights(str(checkpoint), str(tmp_path / "merged"))
    fresh = _lora()
    fresh.load_state_dict(load_file(tmp_path / "merged" / "model.safetensors"))
    plain = fresh.merge_and_unload()
    assert type(plain) is transformers.LlamaForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=_probe()).logits, logits, rtol=1e-4, atol=1e-5)


def adapter_only_round_trip(rank: int, world: int, version: int, kind: str, folder: str) -> dict[str, Any]:
    from fullshard import Accelerator, FullyShardedDataParallelPlugin
    from fullshard.frontend.saving.fsdp_checkpoints import load_fsdp_model, save_fsdp_model

    def prepared() -> tuple[Any, Any, Any]:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type=kind,
                                                auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["LlamaDecoderLayer"])  # fmt: skip
        accelerator = Accelerator(fsdp_plugin=plugin)
        return plugin, accelerator, accelerator.prepare(_lora())

    plugin, accelerator, model = prepared()
    optimizer = accelerator.prepare(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    for step in range(2):  # B starts at zero: A moves from the second step on
        ids = _batch(rank, step)
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    trained = accelerator.get_state_dict(model)
    save_fsdp_model(plugin, accelerator, model, folder, adapter_only=True)
    written = sorted(os.listdir(folder))
    saved_keys = sorted(torch.load(os.path.join(folder, written[0]))) if kind == "FULL_STATE_DICT" else None
    plugin, accelerator, fresh = prepared()
    before = {k: v.clone() for k, v in accelerator.get_state_dict(fresh).items()}
    load_fsdp_model(plugin, accelerator, fresh, folder, adapter_only=True)
    after = accelerator.get_state_dict(fresh)
    if rank != 0:
        return {}
    return {
        "written": written,
        "saved_keys": saved_keys,
        "adapters_changed": sorted(k for k in after if not torch.equal(after[k], before[k])),
        "equal_to_trained": all(torch.equal(after[k], trained[k]) for k in trained),
    }


@pytest.mark.parametrize(("version", "kind"), [(1, "FULL_STATE_DICT"), (2, "SHARDED_STATE_DICT")])
def test_adapter_only_checkpoint_saves_and_loads_the_adapter(
    pool2: WorkerPool, tmp_path: Any, version: int, kind: str
) -> None:
    # was: NotImplementedError("save_fsdp_model(adapter_only=True) of a PEFT model: fullshard saves whole models")
    result = pool2.run(adapter_only_round_trip, version, kind, str(tmp_path))[0]
    adapters = sorted(_adapters(_lora().state_dict()))
    assert result["written"] == (["pytorch_model_fsdp.bin"] if kind == "FULL_STATE_DICT" else ["pytorch_model_fsdp_0"])
    if kind == "FULL_STATE_DICT":
        assert result["saved_keys"] == adapters  # the adapter only: no frozen base weight
    assert result["adapters_changed"] == adapters  # loading changed the adapters and nothing else
    assert result["equal_to_trained"]


def bf16_base_fp32_adapters(rank: int, world: int, version: int, wrap: str) -> dict[str, Any]:
    from peft.utils.other import fsdp_auto_wrap_policy

    from fullshard import Accelerator, FullyShardedDataParallelPlugin

    model = _lora()
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    if wrap == "peft":  # each adapter a unit of its own
        plugin = FullyShardedDataParallelPlugin(fsdp_version=version, auto_wrap_policy=fsdp_auto_wrap_policy(model))
    else:  # adapters in their decoder layer's unit, beside the bf16 base
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=version,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        )
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16")
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    losses = []
    for step in range(3):
        ids = _batch(rank, step)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach().float(), "mean").item())
    dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
    return {"dtypes": dtypes, "losses": losses}


@pytest.mark.parametrize("wrap", ["peft", "layers"])
@pytest.mark.parametrize("version", [1, 2])
def test_bf16_base_with_fp32_adapters(pool2: WorkerPool, version: int, wrap: str) -> None:
    # PEFT casts adapters to fp32. With its wrap policy they are units of their own; PEFT casts an adapter's input
    # to the adapter's (sharded, fp32) weight dtype, and under fsdp_version=1 the unit then computed in bf16 on a
    # float32 input (a dtype mismatch in the first forward) until the Accelerator cast every unit's inputs. With
    # the decoder layers as units, the adapters share a unit with the bf16 base (was refused at prepare).
    result = pool2.run(bf16_base_fp32_adapters, version, wrap)[0]
    assert result["dtypes"] == {(False, torch.bfloat16), (True, torch.float32)}  # the base is not upcast
    model = _lora()
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step, loss in enumerate(result["losses"]):
        ids = torch.cat([_batch(rank, step) for rank in range(2)])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(input_ids=ids, labels=ids).loss
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert loss == pytest.approx(expected.item(), abs=3e-2), step


def projection_units_checkpointed(rank: int, world: int) -> dict[str, Any]:
    from fullshard import checkpoint_module, fully_shard

    model = _lora()
    for layer in model.get_base_model().model.layers:
        checkpoint_module(layer)  # recomputed in backward: its projections' units gather again inside it
        for module in layer.modules():
            if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
                fully_shard(module)
        fully_shard(layer)
    fully_shard(model.get_input_embeddings())
    fully_shard(model.get_output_embeddings())
    fully_shard(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    losses = []
    for step in range(2):
        ids = _batch(rank, step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    full = {n: p.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    return {"adapters": _adapters(full), "losses": losses}


def test_projection_units_inside_checkpointed_layers_train_as_one_process(pool2: WorkerPool) -> None:
    # The leanest layout of docs/finetuning.md: every LoRA projection (frozen base_layer + adapters) a unit inside
    # its decoder layer's unit, the layer recomputed in backward (so each projection is gathered three times a
    # step: forward, recompute, backward), embedding and head units of their own. Adapters after two SGD steps
    # with momentum equal one process on both ranks' rows.
    results = pool2.run(projection_units_checkpointed)
    expected, _ = _reference(2)
    got = results[0]["adapters"]
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    initial = _adapters(_lora().state_dict())
    assert all(not torch.equal(tensor, initial[name]) for name, tensor in expected.items())  # both A and B moved

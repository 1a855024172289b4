"""A transformers ``Trainer`` run of a tiny model built from a config, written as for Accelerate (nothing of
fullshard in it): run it under ``fullshard launch --as_accelerate`` (sharded by fullshard) or ``torchrun``
(Accelerate's DDP on CPU). Rank 0 writes ``result.json`` under ``--output_dir``: the per-step losses and gradient
norms, the evaluation and prediction results, a checksum of the final weights and the training rows each rank
fetched, in order; and ``weights.pt``, the final full state dict.

    python trainer_tiny.py --output_dir OUT [--model gpt2|llama|bert] [--fsdp none|v1|v2] [--max_steps N]
        [--save_steps N] [--resume] [--state_dict_type FULL_STATE_DICT|SHARDED_STATE_DICT] [--save_model]
        [--from_pretrained DIR] [--cpu_ram_efficient_loading] [--activation_checkpointing]
        [--min_num_params N] [--eval_first] [--others_on_meta] [--no_seedable_sampler]

What the FSDP settings did is recorded too: whether each rank's model came out of ``from_pretrained`` on the
meta device, which modules became units, how often each module ran forward with gradients enabled (twice a
step inside a block that activation checkpointing recomputes), and how many elements the model held after an
``evaluate()`` before training.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch
from torch.utils.data import Dataset
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

VOCAB, SEQ = 64, 16


class Tokens(Dataset):
    """Random token rows (the same on every rank): causal LM rows, or classification rows for BERT."""

    def __init__(self, n: int, seed: int, classify: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.classes = torch.randint(0, 2, (n,), generator=g)
        self.classify = classify
        self.fetched: list[int] = []  # the rows asked for, in order

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.fetched.append(int(i))
        labels = self.classes[i] if self.classify else self.ids[i]
        return {"input_ids": self.ids[i], "labels": labels}


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return GPT2LMHeadModel(config)
    if kind == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)  # fmt: skip
        return LlamaForCausalLM(config)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=2)  # fmt: skip
    return BertForSequenceClassification(config)


def fsdp_args(args: argparse.Namespace, layer: str) -> dict[str, object]:
    if args.fsdp == "none":
        return {}
    config: dict[str, object] = {"state_dict_type": args.state_dict_type}
    if args.min_num_params:
        config.update(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=args.min_num_params)
    else:
        config["transformer_layer_cls_to_wrap"] = [layer]
    if args.cpu_ram_efficient_loading:
        config["cpu_ram_efficient_loading"] = True
    if args.activation_checkpointing:
        config["activation_checkpointing"] = True
    if args.fsdp == "v1":  # the string form, FSDP1
        return {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 1, **config}}
    return {"fsdp": True, "fsdp_config": {"version": 2, **config}}


def first(value: object) -> object:
    return value[0] if isinstance(value, tuple) else value


def local_numel(model: torch.nn.Module) -> int:
    """Elements of the parameters this rank holds (a DTensor's local shard only)."""
    return sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())


def units(model: torch.nn.Module) -> list[str]:
    """Names of the modules that are FSDP units (an FSDP1 wrapper, or a module ``fully_shard`` made FSDP<Class>)."""
    return [name for name, m in model.named_modules() if type(m).__name__.startswith(("FSDP", "FullyShardedData"))]


def count_grad_forwards(model: torch.nn.Module) -> dict[str, int]:
    """Per module name, a counter of the forward calls made with gradients enabled (filled as training runs)."""
    counts = dict.fromkeys((name for name, _ in model.named_modules()), 0)

    def hook(name: str) -> Callable[[torch.nn.Module, object, object], None]:
        def count(module: torch.nn.Module, args: object, output: object) -> None:
            if torch.is_grad_enabled():
                counts[name] += 1

        return count

    for name, module in model.named_modules():
        module.register_forward_hook(hook(name))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "llama", "bert"])
    parser.add_argument("--fsdp", default="v2", choices=["none", "v1", "v2"])
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--state_dict_type", default="FULL_STATE_DICT")
    parser.add_argument("--save_model", action="store_true")
    parser.add_argument("--from_pretrained")
    parser.add_argument("--cpu_ram_efficient_loading", action="store_true")
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--min_num_params", type=int, default=0)
    parser.add_argument("--eval_first", action="store_true")
    parser.add_argument("--others_on_meta", action="store_true")
    parser.add_argument("--no_seedable_sampler", action="store_true")
    args = parser.parse_args()

    # The Trainer's default is use_seedable_sampler=True: epoch e is dealt in the order of the seed seed + e
    order = {"accelerator_config": {"use_seedable_sampler": False}} if args.no_seedable_sampler else {}
    layer = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer", "bert": "BertLayer"}[args.model]
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=3,
        max_steps=args.max_steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        **order,
        **fsdp_args(args, layer),
    )
    # After TrainingArguments, as in transformers' examples: the process group is up and the FSDP settings
    # (cpu_ram_efficient_loading) are in the environment when from_pretrained runs.
    model = AutoModelForCausalLM.from_pretrained(args.from_pretrained) if args.from_pretrained else build(args.model)
    on_meta = {"from_pretrained": any(p.is_meta for p in model.parameters())}
    if args.others_on_meta and training_args.process_index > 0:
        # transformers 5 reads the weights on every rank; drop them here, as with a from_pretrained that reads
        # them on rank 0 only: sharding must then take every value, buffers included, from rank 0.
        model.to("meta")
        model.tie_weights()  # leaving for meta made new parameters: tie the output head to the embedding again
    on_meta["trainer"] = any(p.is_meta for p in model.parameters())
    grad_forwards = count_grad_forwards(model)
    classify = args.model == "bert"
    train_rows = Tokens(64, 1, classify)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_rows, eval_dataset=Tokens(10, 2, classify))
    numel_after_eval = None
    if args.eval_first:
        trainer.evaluate()
        numel_after_eval = local_numel(trainer.model)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()
    predictions = trainer.predict(Tokens(10, 2, classify))
    if args.save_model:
        trainer.save_model(os.path.join(args.output_dir, "final"))
    state = trainer.accelerator.get_state_dict(trainer.model)
    on_meta_by_rank: list[object] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(on_meta_by_rank, on_meta)
    fetched_by_rank: list[object] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(fetched_by_rank, train_rows.fetched)
    if trainer.accelerator.is_main_process:
        result = {
            "losses": {str(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e},
            "grad_norms": {str(e["step"]): e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e},
            "eval_loss": metrics["eval_loss"],
            "predictions_shape": list(first(predictions.predictions).shape),
            "weights": {k: float(v.double().sum()) for k, v in sorted(state.items())},
            "accelerator": type(trainer.accelerator).__module__,
            "model_class": type(trainer.model).__name__,
            "local_numel": local_numel(trainer.model),
            "full_numel": sum(v.numel() for v in state.values()),
            "on_meta": on_meta_by_rank,
            "units": units(trainer.model),
            "grad_forwards": grad_forwards,
            "local_numel_after_eval": numel_after_eval,
            "fetched": fetched_by_rank,
        }
        torch.save(state, os.path.join(args.output_dir, "weights.pt"))
        with open(os.path.join(args.output_dir, "result.json"), "w") as fp:
            json.dump(result, fp)


if __name__ == "__main__":
    main()

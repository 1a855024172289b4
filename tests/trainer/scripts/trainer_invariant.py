"""A transformers ``Trainer`` run in world-size-invariant mode, written as for Accelerate: run it under
``fullshard launch --num_processes N --as_accelerate --fsdp_invariant_micro_batches G`` on any ``N`` dividing
``G``. Rank 0 writes ``weights.pt`` (the full state dict after training) and ``result.json`` (the gradient norms
logged per step, an evaluation loss after training, the world size, the accumulation steps) under ``--output_dir``.

    python trainer_invariant.py --output_dir OUT [--micro_batches G] [--no_loss_kwargs] [--accumulation K]
        [--group_by_length]

The FSDP settings come from the launcher (``--use_fsdp --fsdp_version ...``), as with ``accelerate config``:
``TrainingArguments(fsdp=...)`` is refused by the Trainer on one process, and ``G`` has no ``fsdp_config`` key.

The model is a tiny GPT-2 with dropout on; the labels mask a varying number of positions per row (-100), so the
Trainer's ``num_items_in_batch`` (the label tokens of the global batch) differs from step to step.
``gradient_accumulation_steps`` is ``G / world size`` unless ``--accumulation`` says otherwise;
``--no_loss_kwargs`` makes the Trainer normalise the loss itself (the mean over a micro-batch divided by the
accumulation steps) instead of passing ``num_items_in_batch`` to the model.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB, SEQ = 64, 16


class Rows(Dataset):
    """Random token rows, each with its last ``i % 5`` labels masked (-100)."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[SEQ - i % 5 :] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--micro_batches", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=0)
    parser.add_argument("--no_loss_kwargs", action="store_true")
    parser.add_argument("--group_by_length", action="store_true")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=True,
        per_device_train_batch_size=2,  # the micro-batch
        gradient_accumulation_steps=args.accumulation or args.micro_batches // world,  # G / N
        num_train_epochs=2,
        learning_rate=1e-2,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        train_sampling_strategy="group_by_length" if args.group_by_length else "random",
    )
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1)  # fmt: skip
    trainer = Trainer(model=GPT2LMHeadModel(config), args=training_args, train_dataset=Rows(28))
    if args.no_loss_kwargs:
        trainer.model_accepts_loss_kwargs = False
    trainer.train()
    metrics = trainer.evaluate(Rows(10))
    state = trainer.accelerator.get_state_dict(trainer.model)
    if trainer.accelerator.is_main_process:
        torch.save(state, os.path.join(args.output_dir, "weights.pt"))
        result = {
            "world": world,
            "accumulation": training_args.gradient_accumulation_steps,
            "steps": trainer.state.global_step,
            "grad_norms": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e],
            "eval_loss": metrics["eval_loss"],
            "accelerator": type(trainer.accelerator).__module__,
        }
        with open(os.path.join(args.output_dir, "result.json"), "w") as fp:
            json.dump(result, fp)


if __name__ == "__main__":
    main()

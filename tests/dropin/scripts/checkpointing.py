"""Train the toy classifier, saving the training state every N steps or every epoch, and resume from a saved
state; written the way an Accelerate script is (its imports name ``fullshard``; with ``accelerate`` instead it
runs under Accelerate too).

    fullshard launch --config_file fsdp.yaml checkpointing.py --output OUT --checkpointing_steps 5
    fullshard launch --config_file fsdp.yaml checkpointing.py --output OUT2 --resume_from_checkpoint OUT/step_15

A resumed run continues the epoch it stopped in: without ``--use_stateful_dataloader`` it skips the batches
already trained on with ``accelerator.skip_first_batches``; with it, ``load_state`` restores the position. Each
epoch starts with ``set_epoch(epoch)``, as the seedable sampler needs.
Each rank writes ``OUT/rank<k>.json``: the loss of every step (over all ranks) by global step, the mean loss
of each epoch, and the sample indices it trained on in each epoch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from toy_data import Classifier, TeacherDataset

from fullshard import Accelerator, DataLoaderConfiguration, DistributedType
from fullshard.utils import set_seed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--checkpointing_steps", default=None, help="a number of steps, or 'epoch'")
    parser.add_argument("--resume_from_checkpoint", type=Path, default=None)
    parser.add_argument("--use_stateful_dataloader", action="store_true")
    parser.add_argument("--use_seedable_sampler", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    config = DataLoaderConfiguration(
        use_stateful_dataloader=args.use_stateful_dataloader, use_seedable_sampler=args.use_seedable_sampler
    )
    accelerator = Accelerator(dataloader_config=config)
    every = args.checkpointing_steps
    every = int(every) if every is not None and every.isdigit() else every
    set_seed(5)
    train = DataLoader(TeacherDataset(62), batch_size=4, shuffle=True)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.97)
    model, optimizer, train, scheduler = accelerator.prepare(model, optimizer, train, scheduler)

    overall_step, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint is not None:
        accelerator.load_state(args.resume_from_checkpoint)
        name = args.resume_from_checkpoint.name
        if name.startswith("epoch_"):
            starting_epoch = int(name.removeprefix("epoch_")) + 1
            overall_step = starting_epoch * len(train)
        else:
            overall_step = int(name.removeprefix("step_"))
            starting_epoch, resume_step = divmod(overall_step, len(train))
        accelerator.print(f"resumed at epoch {starting_epoch}, step {overall_step}")

    record: dict = {"step_losses": {}, "epoch_losses": {}, "samples": {}}
    for epoch in range(starting_epoch, args.num_epochs):
        model.train()
        train.set_epoch(epoch)  # the seedable sampler deals the order of seed + epoch (the other order ignores it)
        if epoch == starting_epoch and resume_step and not args.use_stateful_dataloader:
            active = accelerator.skip_first_batches(train, resume_step)
        else:
            active = train
        losses, seen = [], []
        for batch in active:
            loss, _ = model(batch["x"], batch["labels"])
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            losses.append(accelerator.gather(loss.detach()).mean().item())
            seen += batch["idx"].tolist()
            record["step_losses"][overall_step] = losses[-1]
            if isinstance(every, int) and overall_step % every == 0:
                accelerator.save_state(args.output / f"step_{overall_step}")
        record["epoch_losses"][epoch] = sum(losses) / len(losses)
        record["samples"][epoch] = seen
        if accelerator.distributed_type != DistributedType.NO:
            accelerator.wait_for_everyone()
        if every == "epoch":
            accelerator.save_state(args.output / f"epoch_{epoch}")
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    main()

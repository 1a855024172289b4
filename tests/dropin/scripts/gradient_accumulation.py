"""Train the toy classifier with gradient accumulation through ``accelerator.accumulate``; written the way an
Accelerate script is (its imports name ``fullshard``; with ``accelerate`` instead it runs under Accelerate too).

    fullshard launch --config_file multi_cpu.yaml gradient_accumulation.py --output OUT --accumulation 3

Each rank writes ``OUT/rank<k>.json``: the mean training loss of each epoch (over all ranks), the sample
indices it trained on in each epoch, and the number of optimizer steps taken.
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--accumulation", type=int, default=3)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--use_seedable_sampler", action="store_true")
    args = parser.parse_args()

    config = DataLoaderConfiguration(use_seedable_sampler=args.use_seedable_sampler)
    accelerator = Accelerator(gradient_accumulation_steps=args.accumulation, dataloader_config=config)
    if accelerator.distributed_type == DistributedType.NO and accelerator.num_processes > 1:
        raise RuntimeError("expected a distributed run")
    set_seed(11)
    train = DataLoader(TeacherDataset(58), batch_size=3, shuffle=True)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.2, total_iters=60)
    model, optimizer, train, scheduler = accelerator.prepare(model, optimizer, train, scheduler)

    record: dict[str, list] = {"epoch_losses": [], "samples": [], "optimizer_steps": 0}
    for _ in range(args.num_epochs):
        model.train()
        losses, seen = [], []
        for batch in train:
            with accelerator.accumulate(model):
                loss, _ = model(batch["x"], batch["labels"])
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                record["optimizer_steps"] += int(accelerator.sync_gradients)
            losses.append(accelerator.gather(loss.detach()).mean().item())
            seen += batch["idx"].tolist()
        record["epoch_losses"].append(sum(losses) / len(losses))
        record["samples"].append(seen)
        accelerator.print(f"epoch loss {record['epoch_losses'][-1]:.4f}")
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    main()

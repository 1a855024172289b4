"""Train the toy classifier, tracking the peak memory of every epoch; written the way an Accelerate FSDP
script is (its imports name ``fullshard``; with ``accelerate`` instead it runs under Accelerate too).

    fullshard launch --config_file fsdp.yaml peak_memory.py --output OUT

Each rank writes ``OUT/rank<k>.json``: the mean training loss of each epoch (over all ranks), the sample
indices it trained on in each epoch, the evaluation accuracy, and the peak memory increase of each epoch.
"""

from __future__ import annotations

import argparse
import gc
import json
import tracemalloc
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from toy_data import Classifier, TeacherDataset

from fullshard import Accelerator, DistributedType, FullyShardedDataParallelPlugin
from fullshard.utils import is_npu_available, is_xpu_available, set_seed


class PeakMemory:
    """The peak memory increase over the block: the device's allocator on accelerators, tracemalloc on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _backend(self):  # the torch.<device> module with memory statistics, or None on CPU
        if self.device.type == "cuda":
            return torch.cuda
        if is_xpu_available() and self.device.type == "xpu":
            return torch.xpu
        if is_npu_available() and self.device.type == "npu":
            return torch.npu
        return None

    def __enter__(self) -> PeakMemory:
        gc.collect()
        backend = self._backend()
        if backend is None:
            # Tracing runs from before the process group's threads exist (see main); here only its peak is reset.
            # Starting and stopping tracemalloc while other threads run crashed a rank once (SIGSEGV in a native
            # thread, CPython 3.11.7): tracemalloc's switch is not safe against threads that allocate meanwhile.
            tracemalloc.reset_peak()
            self.begin = tracemalloc.get_traced_memory()[0]
        else:
            backend.reset_peak_memory_stats()
            self.begin = backend.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        backend = self._backend()
        if backend is None:
            _, peak = tracemalloc.get_traced_memory()
            self.peak_mb = (peak - self.begin) / 2**20
        else:
            self.peak_mb = (backend.max_memory_allocated() - self.begin) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=4)
    args = parser.parse_args()

    tracemalloc.start()  # on CPU, PeakMemory reads its peaks; started before any thread of the process group
    accelerator = Accelerator()
    sharded = accelerator.distributed_type == DistributedType.FSDP
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    accelerator.print(
        f"distributed_type={accelerator.distributed_type} sharded={sharded}",
        f"plugin={isinstance(plugin, FullyShardedDataParallelPlugin)}",
    )
    set_seed(7)
    train = DataLoader(TeacherDataset(70), batch_size=args.batch_size, shuffle=True)
    evaluation = DataLoader(TeacherDataset(30, seed=99), batch_size=8)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=len(train) * 2, gamma=0.5)
    model, optimizer, train, evaluation, scheduler = accelerator.prepare(model, optimizer, train, evaluation, scheduler)

    record: dict[str, list] = {"epoch_losses": [], "samples": [], "accuracy": [], "peak_mb": []}
    for _ in range(args.num_epochs):
        model.train()
        losses, seen = [], []
        with PeakMemory(accelerator.device) as memory:
            for batch in train:
                loss, _ = model(batch["x"], batch["labels"])
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                losses.append(accelerator.gather(loss.detach()).mean().item())
                seen += batch["idx"].tolist()
        model.eval()
        correct = total = 0
        for batch in evaluation:
            with torch.no_grad():
                _, logits = model(batch["x"])
            predictions, labels = accelerator.gather_for_metrics((logits.argmax(dim=1), batch["labels"]))
            correct += (predictions == labels).sum().item()
            total += labels.numel()
        record["epoch_losses"].append(sum(losses) / len(losses))
        record["samples"].append(seen)
        record["accuracy"].append(correct / total)
        record["peak_mb"].append(memory.peak_mb)
        accelerator.print(f"epoch loss {record['epoch_losses'][-1]:.4f} accuracy {correct / total:.3f}")
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    main()

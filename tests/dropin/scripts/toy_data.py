"""The data and model the drop-in scripts train on: a fixed, learnable 3-class problem of a few KB.

Items are dicts with the sample index, so that a script can record which samples each rank saw.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class TeacherDataset(Dataset):
    """``n`` points in R^8 labelled by a fixed random linear teacher (the same for every process)."""

    def __init__(self, n: int, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        teacher = torch.randn(8, 3, generator=g)
        self.y = (self.x @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i], "idx": torch.tensor(i)}


class Classifier(nn.Module):
    """Two linear layers with dropout in between (so the scripts also exercise the RNG)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1))
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.body(x))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else logits.new_zeros(())
        return loss, logits

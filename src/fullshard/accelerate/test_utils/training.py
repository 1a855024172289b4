"""``accelerate.test_utils.training``: the tiny regression problem Accelerate's tests train (``y = a*x + b``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["RegressionDataset", "RegressionModel"]


class RegressionDataset:
    """``length`` samples ``{"x", "y"}`` with ``y = a*x + b`` plus noise of scale 0.1 (numpy's ``default_rng(seed)``:
    ``x`` drawn first, then the noise, both float32)."""

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        noise = rng.normal(scale=0.1, size=(length,)).astype(np.float32)
        self.y = a * self.x + b + noise

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i]}


class RegressionModel(torch.nn.Module):
    """``x * a + b`` with two scalar parameters; prints the dtypes on its first forward."""

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())
        self.first_batch = True

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        if self.first_batch:
            print(f"Model dtype: {self.a.dtype}, {self.b.dtype}. Input dtype: {x.dtype}")  # type: ignore[union-attr]
            self.first_batch = False
        return x * self.a + self.b  # type: ignore[operator]

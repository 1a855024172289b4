"""``benchmarks/dispatch.py --bytes``: what its counter of memory-moving ops records, op by op (single process).

Each kind of write is counted once, by the bytes it writes: an op's output (``cat``), its ``out=`` tensors
(``split_with_sizes_copy``) or its in-place target (``copy_``, ``add_``); compute ops (``mm``) are not counted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from dispatch import _BytesWritten


def test_bytes_written_by_kind_of_write() -> None:
    # - Set up: fp32 tensors of known sizes
    a, b = torch.randn(100), torch.randn(50)
    dest = torch.empty(100)
    blocks = [torch.empty(2, 30), torch.empty(2, 20)]
    m = torch.randn(8, 8)
    # - Run
    with _BytesWritten() as counted:
        dest.copy_(a)  # in place: 400 bytes
        torch.cat([a, b])  # output: 600 bytes
        torch.split_with_sizes_copy(a.view(2, 50), [30, 20], dim=1, out=blocks)  # out=: 400 bytes
        dest.add_(a)  # in place: 400 bytes
        m @ m  # computed, not moved
    # - Check
    assert dict(counted.bytes) == {"copy_": 400, "cat": 600, "split_with_sizes_copy": 400, "add_": 400}

"""What the checkpoint benchmarks share: sharded fp32 weights on 2 gloo ranks, the page cache dropped, the bytes
of a folder, and ``dd``'s sequential write and read bandwidth (see ``checkpoint.py``)."""

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
SIDE = 4096  # each weight is SIDE x SIDE fp32 (64 MiB): the size of a large transformer matrix


def sharded_weights(rank: int, world: int, num_weights: int) -> dict[str, Any]:
    """``num_weights`` random SIDE x SIDE fp32 weights, this rank holding rows ``rank`` of ``world`` (``Shard(0)``)."""
    mesh = init_device_mesh("cpu", (world,))
    rows = SIDE // world
    state = {}
    for i in range(num_weights):
        local = torch.randn(rows, SIDE, generator=torch.Generator().manual_seed(i * world + rank))
        state[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], shape=(SIDE, SIDE), stride=(SIDE, 1))
    return state


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# --- dd --------------------------------------------------------------------------------------------------


def _dd_parallel(commands: list[list[str]]) -> float:
    """Run the dd commands at once; returns the wall time (from start to the last one's exit)."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for cmd in commands]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"dd failed: {err}")
    return time.perf_counter() - t0


def measure_dd(workdir: Path, stream_bytes: int) -> dict[str, float]:
    """GB/s of WORLD parallel sequential streams: write (fdatasync, direct), then cold read (buffered, direct)."""
    block = 64 << 20
    count = max(1, stream_bytes // block)
    files = [workdir / f"dd_{i}.bin" for i in range(WORLD)]
    total = WORLD * count * block
    out = {}
    for name, flag in (("write_fdatasync", "conv=fdatasync"), ("write_direct", "oflag=direct")):
        seconds = _dd_parallel(
            [["dd", "if=/dev/zero", f"of={f}", f"bs={block}", f"count={count}", flag] for f in files]
        )
        out[name] = total / seconds / 1e9
    for name, flag in (("read_buffered", None), ("read_direct", "iflag=direct")):
        drop_caches()
        seconds = _dd_parallel(
            [["dd", f"if={f}", "of=/dev/null", f"bs={block}"] + ([flag] if flag else []) for f in files]
        )
        out[name] = total / seconds / 1e9
    for f in files:
        f.unlink()
    return out

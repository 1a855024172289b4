"""Benchmark: what the checksums of a checkpoint cost, at ~300M fp32 parameters written by 2 gloo ranks.

Each rank holds half of every ``SIDE x SIDE`` weight (``Shard(0)`` DTensors). Alternating, ``--repeats``
times, the same state is written with torch's ``dcp.FileSystemWriter`` (no checksums) and with fullshard's
``write_sharded`` (``ChecksummingFileSystemWriter``: a CRC-32 of every byte as it goes out); both fsync
every file, as DCP does by default. Reports the median wall time of each (from a barrier before the save to
a barrier after it), their ratio (noisy on a shared machine: fsync dominates), and the CPU time spent inside
the CRC-32 function per save (the work the checksums add) as a share of the plain save. The folder is deleted
after each save. Needs ~1.3 GB free under ``--workdir``. ``--crc zlib`` forces the standard library's CRC-32
where ISA-L (the ``isal`` package) is installed.

Then the loads: one ``save_sharded`` folder is loaded back ``--repeats`` times each with ``load_sharded``
checking every item against its recorded CRC-32 (the default, [Note: checked reads] in
``fullshard/checkpoint/reader.py``) and with the check switched off, alternating, each from a cold page cache
(the files' pages are dropped first); reported like the saves.

    python benchmarks/bench_checkpoint.py [--params 300e6] [--repeats 5] [--crc auto|zlib] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIDE = 4096  # 64 MiB per fp32 weight


def _rank(rank: int, world: int, store: str, workdir: str, num_weights: int, repeats: int, out: str, crc: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fullshard.checkpoint import checksum
    from fullshard.checkpoint.dcp import write_sharded

    if crc == "zlib":  # measure the standard library's CRC-32 even where ISA-L is installed
        import zlib

        checksum._crc32 = zlib.crc32

    mesh = init_device_mesh("cpu", (world,))
    rows = SIDE // world
    state = {}
    for i in range(num_weights):
        local = torch.randn(rows, SIDE, generator=torch.Generator().manual_seed(i * world + rank))
        state[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], shape=(SIDE, SIDE), stride=(SIDE, 1))
    state = {"model": state}

    def plain(folder: Path) -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder))

    def checksummed(folder: Path) -> None:
        write_sharded(state, folder)

    crc = checksum.CRC32_IMPLEMENTATION if crc == "auto" else crc
    crc_seconds = [0.0]  # CPU time inside the CRC function itself: the work the checksums add
    inner = checksum._crc32

    def timed_crc32(data: object, value: int = 0) -> int:
        t0 = time.thread_time()  # CPU time: not inflated when the machine is busy with other work
        try:
            return inner(data, value)
        finally:
            crc_seconds[0] += time.thread_time() - t0

    checksum._crc32 = timed_crc32
    times: dict[str, list[float]] = {"plain": [], "crc32": []}
    for r in range(repeats):
        for name, fn in (
            (("plain", plain), ("crc32", checksummed)) if r % 2 == 0 else (("crc32", checksummed), ("plain", plain))
        ):
            folder = Path(workdir) / f"{name}-{r}"
            dist.barrier()
            t0 = time.perf_counter()
            fn(folder)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
            if rank == 0:
                shutil.rmtree(folder)
            dist.barrier()
    spent = [None] * world
    dist.all_gather_object(spent, crc_seconds[0] / repeats)
    load_times, load_spent = _loads(rank, world, state, Path(workdir) / "load", repeats, crc_seconds)
    if rank == 0:
        plain_s, crc_s = statistics.median(times["plain"]), statistics.median(times["crc32"])
        checked, unchecked = statistics.median(load_times["checked"]), statistics.median(load_times["unchecked"])
        gb = num_weights * SIDE * SIDE * 4 / 1e9
        report = (
            f"{num_weights * SIDE * SIDE / 1e6:.0f}M fp32 parameters ({gb:.2f} GB), {world} ranks, {repeats} repeats\n"
            f"plain dcp.FileSystemWriter: median {plain_s:.2f} s  (runs: {[round(t, 2) for t in times['plain']]})\n"
            f"with CRC-32 ({crc}) as written: median {crc_s:.2f} s  (runs: {[round(t, 2) for t in times['crc32']]})\n"
            f"overhead: {100 * (crc_s / plain_s - 1):+.1f}% of wall time (noisy: disk and fsync dominate)\n"
            f"CRC-32 CPU time per save, slowest rank: {max(spent):.3f} s = {100 * max(spent) / plain_s:.1f}% "
            "of the plain save's median\n"
            f"load_sharded, cold cache, items unchecked: median {unchecked:.2f} s  "
            f"(runs: {[round(t, 2) for t in load_times['unchecked']]})\n"
            f"load_sharded, cold cache, every item checked: median {checked:.2f} s  "
            f"(runs: {[round(t, 2) for t in load_times['checked']]})\n"
            f"overhead: {100 * (checked / unchecked - 1):+.1f}% of wall time; CRC-32 CPU time per load, slowest "
            f"rank: {max(load_spent):.3f} s = {100 * max(load_spent) / unchecked:.1f}% of the unchecked load's median"
        )
        Path(out).write_text(report)
        print(report)
    dist.destroy_process_group()


def _drop_from_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _loads(
    rank: int, world: int, state: dict, folder: Path, repeats: int, crc_seconds: list[float]
) -> tuple[dict[str, list[float]], list[float]]:
    """Load one saved folder ``repeats`` times checked and unchecked, alternating; (wall times, CRC CPU per load)."""
    from fullshard.checkpoint.dcp import load_sharded, save_sharded
    from fullshard.checkpoint.reader import SafeFileSystemReader

    save_sharded(state, folder)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    real_expected = SafeFileSystemReader._expected_crc
    times: dict[str, list[float]] = {"checked": [], "unchecked": []}
    crc_seconds[0] = 0.0
    for r in range(repeats):
        for name in ("checked", "unchecked") if r % 2 == 0 else ("unchecked", "checked"):
            SafeFileSystemReader._expected_crc = real_expected if name == "checked" else lambda *a: None
            if rank == 0:
                _drop_from_page_cache(folder)
            dist.barrier()
            t0 = time.perf_counter()
            load_sharded(target, folder)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    SafeFileSystemReader._expected_crc = real_expected
    spent = [None] * world
    dist.all_gather_object(spent, crc_seconds[0] / repeats)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)
    return times, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=300e6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/fullshard-bench-ckpt")
    parser.add_argument("--crc", choices=["auto", "zlib"], default="auto", help="zlib: force the stdlib CRC-32")
    args = parser.parse_args()
    num_weights = max(1, round(args.params / (SIDE * SIDE)))
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "report")
        mp.spawn(_rank, args=(2, store, args.workdir, num_weights, args.repeats, out, args.crc), nprocs=2)


if __name__ == "__main__":
    main()

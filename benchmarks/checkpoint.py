"""Checkpoint benchmarks on 2 gloo CPU ranks: what checksums cost, save/load at the speed of the disk, merging.

    python benchmarks/checkpoint.py checksums [--params 300e6] [--repeats 3] [--crc auto|zlib] [--workdir DIR]
    python benchmarks/checkpoint.py scale [--quick] [--layers 16] [--width 2048] [--fsdp-version 2] [--no-torch]
        [--keep] [--workdir DIR] [--dd-gb 2]
    python benchmarks/checkpoint.py merge [--params 300e6 | --quick | --checkpoint DIR] [--repeats 2] [--dd]
        [--max-shard-size 1GB] [--gpt-layers N] [--workdir DIR]
    python benchmarks/checkpoint.py async [--layers 5] [--width 2048] [--vocab 12288] [--rounds 2] [--steps 2]
        [--cuda]
    python benchmarks/checkpoint.py merge --repeats 1 --dd --max-shard-size 1GB \
        --checkpoint /tmp/fullshard-bench/ckscale/bench_checkpoint_scale/ours/pytorch_model_fsdp_0 --gpt-layers 16

Every mode first prints the machine (``fullshard.testing.bench.describe_machine``).

``checksums``: each rank holds half of every 4096 x 4096 fp32 weight (``Shard(0)`` DTensors, ``--params`` in
all). Alternating, ``--repeats`` times, the state is written with torch's ``dcp.FileSystemWriter`` (no checksums)
and with fullshard's ``write_sharded`` (a CRC-32 of every byte as it goes out), both fsync'ing every file; then
one ``save_sharded`` folder is loaded back with every item checked against its CRC-32 and with the check off,
each from a cold page cache. Prints the median wall time of each (barrier to barrier), the overhead in wall
time (noisy: fsync and the disk dominate) and the CPU time spent inside the CRC-32 function per save and per load
(the work the checksums add) as a share of the plain operation. ``--crc zlib`` forces the standard library's
CRC-32 where ISA-L is installed. Needs ~1.3 GB free under ``--workdir``.

``scale``: the GPT of issue 11 (default 16 layers x 2048, vocabulary 8192, about 840M parameters; ``--quick``:
2 layers, about 135M) under ``Accelerator`` (FULL_SHARD, ``SHARDED_STATE_DICT``, built on the meta device), one
AdamW step, then: ``dd``'s sequential write and cold read bandwidth under ``--workdir`` (two parallel streams);
``Accelerator.save_state`` and torch's ``dcp.save`` of the same state dicts; after dropping the page cache,
``Accelerator.load_state`` and ``dcp.load`` into zeroed state, each checked against a fingerprint of the saved
state. Prints per phase: seconds, GB/s and its share of ``dd``'s, peak RSS per rank (sampled every 2 ms, against
the training step's) and whether the load was correct. Needs root (drop_caches) and about 2.5x the checkpoint
free under ``--workdir``; run the full size alone (about 16 GB of memory). Deletes what it wrote unless ``--keep``.

``async``: the GPT of ``scale`` (default 5 layers x 2048, vocabulary 12288: 302M parameters) under
``Accelerator`` with AdamW, one training step, then ``--rounds`` pairs of saves in one run, alternating
``save_state(dir)`` and ``save_state(dir, async_save=True)``; after each, ``--steps`` training steps, then the
wait for the background write (what the next ``save_state`` would wait). Prints per save the time the call held
the training loop (``blocked``), the steps' times (an async save's steps run beside its write), the wait after
them, the peak RSS per rank of each save's phase and the host buffers the async saves keep (every phase from the
first async save on holds them; later async saves copy into them instead of allocating). Each checkpoint is
deleted after its round; needs about 2x the checkpoint in memory beside training. ``--cuda``: one NCCL rank on
this machine's GPU instead (the state on the GPU, its async copies into pinned host memory).

``merge``: writes a sharded fp32 checkpoint in Accelerate's layout (``pytorch_model_fsdp_0``, 2 ranks, ``--params``
parameters) or takes ``--checkpoint``, then runs fullshard's ``merge_fsdp_weights`` and Accelerate's, each in a
fresh subprocess, alternating ``--repeats`` times. Prints each run's time and peak RSS (the child's ``VmHWM``),
the best of each and the ratio ours/accelerate, whether both outputs hold the same tensors; with ``--dd`` the
time against reading and writing the same bytes at ``dd``'s bandwidth; with ``--gpt-layers`` whether our output
loads into the GPT of ``scale`` (``load_checkpoint_in_model``) equal to Accelerate's. Needs ``accelerate``.

``checksums`` and ``scale`` live here; ``async`` in ``checkpoint_async.py``, ``merge`` in ``checkpoint_merge.py``,
and what they share (the sharded weights, ``dd``, the page cache) in ``checkpoint_disk.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from checkpoint_async import async_args, async_main
from checkpoint_disk import SIDE, WORLD, drop_caches, folder_bytes, measure_dd, sharded_weights
from checkpoint_merge import merge_args, merge_main

from fullshard import Accelerator, FullyShardedDataParallelPlugin
from fullshard.checkpoint import checksum
from fullshard.checkpoint.dcp import load_sharded, save_sharded
from fullshard.checkpoint.reader import SafeFileSystemReader
from fullshard.checkpoint.writer import write_sharded
from fullshard.frontend.saving import model_state
from fullshard.testing.bench import RssSampler, on_fresh_ranks, run_mode
from fullshard.testing.models import GPTConfig, TinyGPT, make_batch

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # inherited by the spawned ranks: frees show in RSS


# ==== checksums ==========================================================================================


def _checksums_rank(rank: int, world: int, workdir: str, num_weights: int, repeats: int, crc: str) -> str | None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)

    if crc == "zlib":  # measure the standard library's CRC-32 even where ISA-L is installed
        import zlib

        checksum._crc32 = zlib.crc32

    state = {"model": sharded_weights(rank, world, num_weights)}

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
        return report
    return None


def _drop_from_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _loads(
    rank: int, world: int, state: dict, folder: Path, repeats: int, crc_seconds: list[float]
) -> tuple[dict[str, list[float]], list[float]]:
    """Load one saved folder ``repeats`` times checked and unchecked, alternating; (wall times, CRC CPU per load)."""
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


def checksums_main(args: argparse.Namespace) -> None:
    num_weights = max(1, round(args.params / (SIDE * SIDE)))
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    reports = on_fresh_ranks(_checksums_rank, args.workdir, num_weights, args.repeats, args.crc, world=WORLD)
    print(reports[0])


# ==== scale ==============================================================================================

# --- the ranks ---------------------------------------------------------------------------------------------


def _fingerprint(tensors: list[Any]) -> list[float]:
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    return [float(local(t).double().sum()) if local(t).numel() else 0.0 for t in tensors]


def _state_tensors(model: Any, optimizer: Any) -> list[Any]:
    tensors = [p for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v for k, v in sorted(state.items()) if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tensors


def _zero(tensors: list[Any]) -> None:
    with torch.no_grad():
        for t in tensors:
            (t.to_local() if hasattr(t, "to_local") else t).zero_()


def _materialize(module: Any) -> None:
    """``param_init_fn`` of FSDP (version 1): storage for this module's own meta tensors (values are set later)."""
    module.to_empty(device="cpu", recurse=False)


def _scale_rank(
    rank: int, world: int, cfg_args: dict[str, int], workdir: str, version: int, with_torch: bool = True
) -> dict[str, Any] | None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    sampler = RssSampler(0.002, keep_samples=False).start()
    cfg = GPTConfig(**cfg_args)
    torch.manual_seed(0)
    sampler.set_phase("build")
    with torch.device("meta"):  # no rank ever holds the whole model: sharding allocates only the shards
        model = TinyGPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=version,
        # FSDP (version 1) materialises each unit as it wraps it, like torch's FSDP1; fully_shard's shards get
        # storage from model.to_empty below. Values do not matter here, only their size.
        param_init_fn=_materialize if version == 1 else None,
        sharding_strategy="FULL_SHARD",
        state_dict_type="SHARDED_STATE_DICT",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
    )
    accelerator = Accelerator(fsdp_plugin=plugin)
    if version == 1:  # the FSDP1 way: the optimizer is built on the wrapped (materialised) parameters
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = accelerator.prepare(model, optimizer)
    if version == 2:
        model.to_empty(device="cpu")  # the shards get storage; the values do not matter here, only their size
    generator = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.normal_(0.0, 0.02, generator=generator)
    x, y = make_batch(cfg, 2 * WORLD, seed=0)
    x, y = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
    dist.barrier()
    sampler.set_phase("train")
    t0 = time.perf_counter()
    loss = model(x, y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as in a training loop
    train_s = time.perf_counter() - t0
    dist.barrier()
    sampler.set_phase("idle")
    tensors = _state_tensors(model, optimizer)
    saved = _fingerprint(tensors)
    work = Path(workdir)
    times: dict[str, float] = {}

    def timed(name: str, fn: Any) -> None:
        dist.barrier()
        sampler.set_phase(name)
        t = time.perf_counter()
        fn()
        dist.barrier()
        times[name] = time.perf_counter() - t
        sampler.set_phase("idle")
        folder = work / ("ours" if name in ("save_state", "load_state") else "torch")
        gb = folder_bytes(folder) / 1e9 if rank == 0 else 0.0
        # As it happens, so that a later phase that fails (e.g. out of memory) does not take these figures along.
        print(f"rank {rank}: {name} {times[name]:.2f} s ({gb:.2f} GB), peak RSS {sampler.peaks[name] / 2**30:.2f} "
              f"GiB, training peak {sampler.peaks['train'] / 2**30:.2f} GiB", flush=True)  # fmt: skip

    def torch_save() -> None:
        msd = {"model": model_state.sharded_model_state_dict(model, plugin)}
        dcp.save(msd, storage_writer=dcp.FileSystemWriter(work / "torch" / "pytorch_model_fsdp_0"))
        del msd
        osd = {"optimizer": model_state.optim_state(model, optimizer, plugin)}
        dcp.save(osd, storage_writer=dcp.FileSystemWriter(work / "torch" / "optimizer_0"))

    def torch_load() -> None:
        msd = {"model": model_state.sharded_model_state_dict(model, plugin)}
        dcp.load(msd, storage_reader=dcp.FileSystemReader(work / "torch" / "pytorch_model_fsdp_0"))
        model_state.finish_model_load(model, plugin, msd["model"])
        del msd
        osd = {"optimizer": model_state.optim_state(model, optimizer, plugin)}
        dcp.load(osd, storage_reader=dcp.FileSystemReader(work / "torch" / "optimizer_0"))
        model_state.load_optim_state(model, optimizer, plugin, osd["optimizer"])

    saves = [("save_state", lambda: accelerator.save_state(work / "ours")), ("dcp.save", torch_save)]
    loads = [("load_state", lambda: accelerator.load_state(work / "ours")), ("dcp.load", torch_load)]
    if not with_torch:  # fullshard's phases only (torch's dcp.load of a large state may not fit beside them)
        saves, loads = saves[:1], loads[:1]
    for name, fn in saves:
        timed(name, fn)
    correct = {}
    for name, fn in loads:
        _zero(tensors)
        dist.barrier()
        if rank == 0:
            drop_caches()  # a cold load: every byte comes from the disk
        timed(name, fn)
        correct[name] = _fingerprint(_state_tensors(model, optimizer)) == saved
    peaks = sampler.stop()
    result = {"rank": rank, "times": times, "peaks": peaks, "correct": correct, "train_s": train_s}
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, result)
    if rank != 0:
        return None
    sizes = {"ours": folder_bytes(work / "ours"), "torch": folder_bytes(work / "torch") if with_torch else 0}
    return {"ranks": everyone, "sizes": sizes, "params": n_params}


def scale_main(args: argparse.Namespace) -> None:
    layers = args.layers or (2 if args.quick else 16)
    cfg = {"vocab_size": 8192, "block_size": 128, "n_layer": layers, "n_head": 16, "n_embd": args.width}
    work = Path(args.workdir) / "bench_checkpoint_scale"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"workdir {work}")
    try:
        # Stream size: what each rank writes (12 bytes per parameter: weights and AdamW's two moments, halved).
        approx_params = layers * 12.6 * args.width**2 + 2 * 8192 * args.width
        stream = int(min(approx_params * 12 / WORLD, args.dd_gb * 1e9))
        dd_before = measure_dd(work, stream)
        print("dd before (GB/s):", {k: round(v, 2) for k, v in dd_before.items()})
        result = on_fresh_ranks(_scale_rank, cfg, str(work), args.fsdp_version, not args.no_torch, world=WORLD)[0]
        dd_after = measure_dd(work, stream)
        print("dd after  (GB/s):", {k: round(v, 2) for k, v in dd_after.items()})
        report_scale(result, dd_before, dd_after, cfg, args.fsdp_version)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def report_scale(result: dict[str, Any], dd0: dict[str, float], dd1: dict[str, float], cfg: dict, version: int) -> None:
    ranks = result["ranks"]
    size = result["sizes"]
    dd = {k: (dd0[k] + dd1[k]) / 2 for k in dd0}
    gib = 2**30
    print(
        f"\nGPT {cfg['n_layer']} layers x {cfg['n_embd']}: {result['params'] / 1e6:.0f}M parameters; fsdp_version="
        f"{version}, FULL_SHARD, SHARDED_STATE_DICT, {WORLD} gloo ranks; load average {os.getloadavg()}"
    )
    print(f"checkpoint bytes: fullshard {size['ours'] / 1e9:.2f} GB, torch dcp {size['torch'] / 1e9:.2f} GB")
    rates = ", ".join(f"{k} {v:.2f}" for k, v in dd.items())
    print(f"dd (mean of before/after, {WORLD} parallel streams, GB/s): {rates}")
    train_peak = max(r["peaks"]["train"] for r in ranks)
    print(f"training step {max(r['train_s'] for r in ranks):.1f} s, peak RSS per rank {train_peak / gib:.2f} GiB")
    phases = {k: max(r["peaks"][k] for r in ranks) / gib for k in ranks[0]["peaks"]}
    print("peak RSS per rank by phase (GiB):", {k: round(v, 2) for k, v in phases.items()})
    header = f"{'phase':<11} {'time s':>7} {'GB/s':>6} {'vs dd':>6} {'peak RSS GiB':>13} {'x train':>8}  correct"
    print(header)
    for phase, key, ref in (
        ("save_state", "ours", "write_fdatasync"),
        ("dcp.save", "torch", "write_fdatasync"),
        ("load_state", "ours", "read_buffered"),
        ("dcp.load", "torch", "read_buffered"),
    ):
        if phase not in ranks[0]["times"]:
            continue
        seconds = max(r["times"][phase] for r in ranks)
        peak = max(r["peaks"][phase] for r in ranks)
        rate = size[key] / seconds / 1e9
        ok = all(r["correct"].get(phase, True) for r in ranks)
        print(
            f"{phase:<11} {seconds:7.2f} {rate:6.2f} {rate / dd[ref]:6.0%} {peak / gib:13.2f} "
            f"{peak / train_peak:8.2f}  {ok if phase.startswith('load') or phase.endswith('load') else ''}"
        )
    print(
        "(loads are cold: the page cache was dropped before each; 'vs dd' is against the write_fdatasync / "
        "read_buffered bandwidth)"
    )


def _checksums_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=float, default=300e6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/fullshard-bench-ckpt")
    parser.add_argument("--crc", choices=["auto", "zlib"], default="auto", help="zlib: force the stdlib CRC-32")


def _scale_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="2 layers (~135M parameters, ~1.6 GB checkpoint)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--fsdp-version", type=int, default=2, choices=[1, 2])
    parser.add_argument("--workdir", default="/tmp/fullshard-bench/ckscale")
    parser.add_argument("--dd-gb", type=float, default=2.0, help="GB each of the 2 dd streams writes and reads")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's dcp.save / dcp.load phases")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints (for merge --checkpoint)")


MODES = {
    "checksums": (_checksums_args, checksums_main, "what the CRC-32 checksums cost a sharded save and load"),
    "scale": (_scale_args, scale_main, "save_state/load_state of a GPT's training state against dd and torch's DCP"),
    "merge": (merge_args, merge_main, "merge_fsdp_weights, ours against Accelerate's"),
    "async": (async_args, async_main, "time the training loop is blocked per save_state, async_save vs not"),
}


def main() -> None:
    run_mode(__doc__, MODES)


if __name__ == "__main__":
    main()

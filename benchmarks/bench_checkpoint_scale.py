"""Benchmark: save_state / load_state of a GPT's training state at the speed of the disk, beside torch's DCP.

Builds the GPT of issue 11 (default: 16 layers, width 2048, 16 heads, vocabulary 8192, sequence 128, about
840M parameters; ``--quick``: 2 layers, about 135M) on 2 gloo ranks with ``Accelerator`` (FULL_SHARD,
``SHARDED_STATE_DICT``; built on the meta device, each rank's shards then initialised in place), takes one
AdamW step so the optimizer state exists, and then, in this order:

1. ``dd``: the sequential write bandwidth of the file system under ``--workdir`` (two streams in parallel, as
   two ranks write, each ``conv=fdatasync`` and each ``oflag=direct``), and its read bandwidth after dropping the
   page cache (buffered and ``iflag=direct``);
2. ``Accelerator.save_state`` (fullshard) and ``torch.distributed.checkpoint.save`` of the same two state dicts
   (``{"model": ...}``, ``{"optimizer": ...}``, the folders Accelerate writes), alternating;
3. after ``echo 3 > /proc/sys/vm/drop_caches`` (a *cold* load: every byte comes from the disk),
   ``Accelerator.load_state`` and ``torch.distributed.checkpoint.load`` into the same templates, each after the
   model and optimizer state were zeroed, each checked against a fingerprint of the saved state.

Peak RSS per rank is sampled every 2 ms in each phase (``MALLOC_MMAP_THRESHOLD_=131072`` so freed buffers leave
the RSS), and compared with the training step's. Needs root (for drop_caches) and about 2.5x the checkpoint
size free under ``--workdir``; deletes what it wrote. Run the full size alone on the machine (it needs about 16 GB)::

    python benchmarks/bench_checkpoint_scale.py --quick --workdir /tmp/fullshard-bench/ckscale
    python benchmarks/bench_checkpoint_scale.py --workdir /tmp/fullshard-bench/ckscale
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # inherited by the spawned ranks: frees show in RSS

WORLD = 2
PAGE = os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds; ``phase(name)`` starts a new per-phase maximum."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peaks: dict[str, int] = {}
        self._phase = "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def _run(self) -> None:
        while not self._stop.is_set():
            value, phase = self.rss(), self._phase
            if value > self.peaks.get(phase, 0):
                self.peaks[phase] = value
            time.sleep(self.interval)

    def phase(self, name: str) -> None:
        self._phase = name
        self.peaks[name] = max(self.peaks.get(name, 0), self.rss())

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


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


# --- the ranks ---------------------------------------------------------------------------------------------


def _fingerprint(tensors: list[Any]) -> list[float]:
    import torch

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    return [float(local(t).double().sum()) if local(t).numel() else 0.0 for t in tensors]


def _state_tensors(model: Any, optimizer: Any) -> list[Any]:
    import torch

    tensors = [p for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v for k, v in sorted(state.items()) if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tensors


def _zero(tensors: list[Any]) -> None:
    import torch

    with torch.no_grad():
        for t in tensors:
            (t.to_local() if hasattr(t, "to_local") else t).zero_()


def _materialize(module: Any) -> None:
    """``param_init_fn`` of FSDP (version 1): storage for this module's own meta tensors (values are set later)."""
    module.to_empty(device="cpu", recurse=False)


def _rank(
    rank: int, store: str, cfg_args: dict[str, int], workdir: str, version: int, out: str, with_torch: bool = True
) -> None:
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    from fullshard import Accelerator, FullyShardedDataParallelPlugin
    from fullshard.frontend import model_state
    from fullshard.testing.models import GPTConfig, TinyGPT, make_batch

    sampler = RssSampler()
    cfg = GPTConfig(**cfg_args)
    torch.manual_seed(0)
    sampler.phase("build")
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
    sampler.phase("train")
    t0 = time.perf_counter()
    loss = model(x, y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as in a training loop
    train_s = time.perf_counter() - t0
    dist.barrier()
    sampler.phase("idle")
    tensors = _state_tensors(model, optimizer)
    saved = _fingerprint(tensors)
    work = Path(workdir)
    times: dict[str, float] = {}

    def timed(name: str, fn: Any) -> None:
        dist.barrier()
        sampler.phase(name)
        t = time.perf_counter()
        fn()
        dist.barrier()
        times[name] = time.perf_counter() - t
        sampler.phase("idle")
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
    if rank == 0:
        sizes = {"ours": folder_bytes(work / "ours"), "torch": folder_bytes(work / "torch") if with_torch else 0}
        Path(out).write_text(json.dumps({"ranks": everyone, "sizes": sizes, "params": n_params}))
    dist.barrier()
    dist.destroy_process_group()


def _lscpu_model() -> str:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    match = re.search(r"Model name:\s*(.+)", text)
    return match.group(1).strip() if match else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 layers (~135M parameters, ~1.6 GB checkpoint)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--fsdp-version", type=int, default=2, choices=[1, 2])
    parser.add_argument("--workdir", default="/tmp/fullshard-bench/ckscale")
    parser.add_argument("--dd-gb", type=float, default=2.0, help="GB each of the 2 dd streams writes and reads")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's dcp.save / dcp.load phases")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints (e.g. for bench_merge_scale)")
    args = parser.parse_args()
    layers = args.layers or (2 if args.quick else 16)
    cfg = {"vocab_size": 8192, "block_size": 128, "n_layer": layers, "n_head": 16, "n_embd": args.width}
    work = Path(args.workdir) / "bench_checkpoint_scale"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    import torch.multiprocessing as mp

    print(f"cpu: {_lscpu_model()}; load before: {os.getloadavg()}; workdir {work}")
    try:
        # Stream size: what each rank writes (12 bytes per parameter: weights and AdamW's two moments, halved).
        approx_params = layers * 12.6 * args.width**2 + 2 * 8192 * args.width
        stream = int(min(approx_params * 12 / WORLD, args.dd_gb * 1e9))
        dd_before = measure_dd(work, stream)
        print("dd before (GB/s):", {k: round(v, 2) for k, v in dd_before.items()})
        with tempfile.TemporaryDirectory() as tmp:
            store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
            mp.spawn(_rank, args=(store, cfg, str(work), args.fsdp_version, out, not args.no_torch), nprocs=WORLD)
            result = json.loads(Path(out).read_text())
        dd_after = measure_dd(work, stream)
        print("dd after  (GB/s):", {k: round(v, 2) for k, v in dd_after.items()})
        report(result, dd_before, dd_after, cfg, args.fsdp_version)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def report(result: dict[str, Any], dd0: dict[str, float], dd1: dict[str, float], cfg: dict, version: int) -> None:
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


if __name__ == "__main__":
    main()

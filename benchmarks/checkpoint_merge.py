"""``checkpoint.py merge``: fullshard's ``merge_fsdp_weights`` against Accelerate's, each in a fresh subprocess
(see ``checkpoint.py``)."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from checkpoint_disk import ROOT, SIDE, WORLD, drop_caches, measure_dd, sharded_weights
from torch.distributed.tensor import DTensor, Shard

from fullshard import load_checkpoint_in_model
from fullshard.testing.bench import on_fresh_ranks
from fullshard.testing.models import GPTConfig, TinyGPT

# ==== merge ==============================================================================================


def _write_rank(rank: int, world: int, folder: str, num_weights: int) -> None:
    state = sharded_weights(rank, world, num_weights)
    mesh = next(iter(state.values())).device_mesh
    state["norm.weight"] = DTensor.from_local(torch.ones(SIDE // world), mesh, [Shard(0)], shape=(SIDE,), stride=(1,))
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(folder))


_CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
which, ckpt, out, shard = sys.argv[1:5]
if which == "ours":
    from fullshard.checkpoint.merge import merge_fsdp_weights
    kwargs = {"show_progress": False, "max_shard_size": shard if shard != "none" else None}
else:
    from accelerate.utils import merge_fsdp_weights
    kwargs = {}
t0 = time.perf_counter()
merge_fsdp_weights(ckpt, out, **kwargs)
seconds = time.perf_counter() - t0
from fullshard.testing.memory import peak_rss_bytes  # VmHWM: ru_maxrss would count this parent's
print(json.dumps({"merge_s": seconds, "peak_rss_mb": peak_rss_bytes() / 2**20}))
"""


def _run_child(which: str, ckpt: Path, out: Path, shard: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, which, str(ckpt), str(out), shard], env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{which} merge failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


def _safetensors_files(folder: Path) -> dict[str, Path]:
    """Every tensor name in the safetensors output under ``folder`` (one file or shards), and its file."""
    from safetensors import safe_open

    where = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    return where


def _same_tensors(a: Path, b: Path) -> bool:
    """Both output folders hold the same names and bitwise equal tensors (read one tensor at a time)."""
    from safetensors import safe_open

    in_a, in_b = _safetensors_files(a), _safetensors_files(b)
    if set(in_a) != set(in_b):
        return False
    for name in in_a:
        with safe_open(in_a[name], "pt") as fa, safe_open(in_b[name], "pt") as fb:
            if not torch.equal(fa.get_tensor(name), fb.get_tensor(name)):
                return False
    return True


def _gpt_equals(out: Path, reference: Path, layers: int, width: int) -> bool:
    """``load_checkpoint_in_model`` of ``out`` into the GPT gives every tensor of ``reference``, bitwise."""
    from safetensors import safe_open

    cfg = GPTConfig(vocab_size=8192, block_size=128, n_layer=layers, n_head=16, n_embd=width)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    load_checkpoint_in_model(model, out, strict=True)
    state = model.state_dict()
    ref = _safetensors_files(reference)
    if set(ref) != set(state):
        return False
    for name, file in ref.items():
        with safe_open(file, "pt") as f:
            if not torch.equal(f.get_tensor(name), state[name]):
                return False
    return True


def merge_main(args: argparse.Namespace) -> None:
    if args.quick:
        args.params, args.repeats = 100e6, 1

    work = Path(args.workdir or tempfile.mkdtemp(prefix="fullshard-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    num_weights = max(1, round(args.params / (SIDE * SIDE)))
    ckpt = Path(args.checkpoint) if args.checkpoint else work / "pytorch_model_fsdp_0"
    try:
        print(f"load: {os.getloadavg()}")
        if args.checkpoint is None:
            t0 = time.perf_counter()
            on_fresh_ranks(_write_rank, str(ckpt), num_weights, world=WORLD)
            n = num_weights * SIDE * SIDE + SIDE
            print(
                f"checkpoint: {n / 1e6:.1f}M fp32 params in {num_weights} tensors of {SIDE}x{SIDE}, 2 ranks, "
                f"written in {time.perf_counter() - t0:.1f}s"
            )
        size = sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file())
        print(f"checkpoint {ckpt}: {size / 1e9:.2f} GB")
        dd = None
        if args.dd:
            dd = measure_dd(work, size // 2)
            print("dd (GB/s, 2 parallel streams):", {k: round(v, 2) for k, v in dd.items()})
        results: dict[str, list[dict[str, float]]] = {"ours": [], "accelerate": []}
        for _ in range(args.repeats):
            for which in results:
                out = work / f"out_{which}"
                shutil.rmtree(out, ignore_errors=True)
                if args.dd:  # a cold read: the checkpoint comes from the disk, for both
                    drop_caches()
                results[which].append(_run_child(which, ckpt, out, args.max_shard_size))
                print(f"  {which:>10}: {json.dumps({k: round(v, 2) for k, v in results[which][-1].items()})}")
        best = {w: {k: min(r[k] for r in rs) for k in rs[0]} for w, rs in results.items()}
        for key in ("merge_s", "wall_s", "peak_rss_mb"):
            ratio = best["ours"][key] / best["accelerate"][key]
            print(
                f"{key:>12}: ours {best['ours'][key]:8.2f}  accelerate {best['accelerate'][key]:8.2f}  "
                f"ratio ours/accelerate {ratio:.3f}"
            )
        if dd is not None:
            floor = size / (dd["read_buffered"] * 1e9) + size / (dd["write_fdatasync"] * 1e9)
            for which in results:
                ratio = best[which]["merge_s"] / floor
                print(f"{which:>10}: {best[which]['merge_s']:.1f} s = {ratio:.2f}x the dd time to read and write "
                      f"{size / 1e9:.2f} GB ({floor:.1f} s)")  # fmt: skip
        outputs = {w: sorted(p.name for p in (work / f"out_{w}").iterdir()) for w in results}
        print(f"output files: {outputs}")
        same = _same_tensors(work / "out_ours", work / "out_accelerate")
        print(f"outputs hold identical tensors: {same}")
        if args.gpt_layers:
            ok = _gpt_equals(work / "out_ours", work / "out_accelerate", args.gpt_layers, 2048)
            print(f"load_checkpoint_in_model(GPT, ours) equals Accelerate's merge, every tensor: {ok}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def merge_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=float, default=300e6, help="approximate parameter count")
    parser.add_argument("--quick", action="store_true", help="100M parameters, one repeat")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each merge (alternating); best is reported")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp folder, removed after)")
    parser.add_argument("--checkpoint", default=None, help="merge this model folder instead of writing one")
    parser.add_argument("--max-shard-size", default="none", help='ours only, e.g. "1GB" (default: one file)')
    parser.add_argument("--dd", action="store_true", help="measure dd read/write bandwidth in the same run")
    parser.add_argument("--gpt-layers", type=int, default=None, help="check our output in the GPT (width 2048)")

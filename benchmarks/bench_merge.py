"""Benchmark: merge a ~300M-parameter fp32 checkpoint written by 2 ranks, ours vs Accelerate's merge_fsdp_weights.

Writes ``{workdir}/pytorch_model_fsdp_0`` in Accelerate's layout (``dcp.save({"model": sharded_sd})``, 2 gloo
ranks, ``Shard(0)`` DTensors), then runs each merge in a fresh subprocess (alternating, ``--repeats`` times)
and reports wall time and peak RSS (the child's own ``ru_maxrss``), the ratios ours/accelerate, and checks
that both outputs hold the same tensors. Needs ``accelerate`` installed and ~4 GB free under ``--workdir``.

    python benchmarks/bench_merge.py [--params 300e6] [--repeats 2] [--workdir /tmp/fullshard-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDE = 4096  # each weight is SIDE x SIDE fp32 (64 MiB): the size of a large transformer matrix


def _write_rank(rank: int, world: int, folder: str, num_weights: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows = SIDE // world
    state = {}
    for i in range(num_weights):
        g = torch.Generator().manual_seed(i * world + rank)
        local = torch.randn(rows, SIDE, generator=g)
        state[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], shape=(SIDE, SIDE), stride=(SIDE, 1))
    state["norm.weight"] = DTensor.from_local(torch.ones(SIDE // world), mesh, [Shard(0)], shape=(SIDE,), stride=(1,))
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(folder))


_CHILD = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
which, ckpt, out = sys.argv[1:4]
if which == "ours":
    from fullshard.checkpoint.merge import merge_fsdp_weights
    kwargs = {"show_progress": False}
else:
    from accelerate.utils import merge_fsdp_weights
    kwargs = {}
t0 = time.perf_counter()
merge_fsdp_weights(ckpt, out, **kwargs)
seconds = time.perf_counter() - t0
print(json.dumps({"merge_s": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _run_child(which: str, ckpt: Path, out: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, which, str(ckpt), str(out)], env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{which} merge failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


def _same_tensors(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        names = list(fa.keys())
        if set(names) != set(fb.keys()):
            return False
        return all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=300e6, help="approximate parameter count")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each merge (alternating); best is reported")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp folder, removed after)")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "src"))
    from fullshard.testing import run_on_ranks

    work = Path(args.workdir or tempfile.mkdtemp(prefix="fullshard-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    num_weights = max(1, round(args.params / (SIDE * SIDE)))
    ckpt = work / "pytorch_model_fsdp_0"
    try:
        t0 = time.perf_counter()
        run_on_ranks(_write_rank, 2, str(ckpt), num_weights)
        n = num_weights * SIDE * SIDE + SIDE
        gib = sum(f.stat().st_size for f in ckpt.iterdir()) / 2**30
        print(
            f"checkpoint: {n / 1e6:.1f}M fp32 params in {num_weights} tensors of {SIDE}x{SIDE}, 2 ranks, "
            f"{gib:.2f} GiB, written in {time.perf_counter() - t0:.1f}s"
        )
        results: dict[str, list[dict[str, float]]] = {"ours": [], "accelerate": []}
        for _ in range(args.repeats):
            for which in results:
                out = work / f"out_{which}"
                shutil.rmtree(out, ignore_errors=True)
                results[which].append(_run_child(which, ckpt, out))
                print(f"  {which:>10}: {json.dumps({k: round(v, 2) for k, v in results[which][-1].items()})}")
        best = {w: {k: min(r[k] for r in rs) for k in rs[0]} for w, rs in results.items()}
        for key in ("merge_s", "wall_s", "peak_rss_mb"):
            ratio = best["ours"][key] / best["accelerate"][key]
            print(
                f"{key:>12}: ours {best['ours'][key]:8.2f}  accelerate {best['accelerate'][key]:8.2f}  "
                f"ratio ours/accelerate {ratio:.3f}"
            )
        same = _same_tensors(work / "out_ours" / "model.safetensors", work / "out_accelerate" / "model.safetensors")
        print(f"outputs hold identical tensors: {same}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

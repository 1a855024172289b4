"""merge_fsdp_weights streams: its peak memory is about the largest tensor, not the model ([Note: streaming merge]).

A checkpoint of 16 tensors of 16 MiB (256 MiB) is merged in a fresh process whose peak RSS is reset just before the
merge (``/proc/self/clear_refs``), with ``MALLOC_MMAP_THRESHOLD_`` set so freed tensors leave the RSS. The growth of
the process's peak RSS over its RSS just before the merge must stay under four tensors (two are held by design:
the one being written and the one read ahead), far under the 256 MiB a whole-model merge holds. The merged
shards must equal the saved tensors bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from fullshard.checkpoint.reader import quiet_single_process_warning

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, sys
import torch
from fullshard.checkpoint.merge import merge_fsdp_weights
from fullshard.testing.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
reset_peak_rss()  # imports no longer count
before = rss_bytes()
merge_fsdp_weights(sys.argv[1], sys.argv[2], max_shard_size="64MiB", show_progress=False)
print(json.dumps({"before": before, "peak": peak_rss_bytes()}))
"""


def test_merge_peak_memory_is_a_few_tensors_not_the_model_and_the_output_is_exact(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    weights = {f"layers.{i}.weight": torch.randn(2048, 2048, generator=g) for i in range(16)}  # 16 MiB each
    with quiet_single_process_warning():
        dcp.save({"model": weights}, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt"), no_dist=True)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "ckpt"), str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = result["peak"] - result["before"]
    model = sum(t.nbytes for t in weights.values())
    assert growth < 4 * 16 * MIB, f"the merge held {growth / MIB:.0f} MiB; the model is {model / MIB:.0f} MiB"
    merged = {}
    for file in sorted((tmp_path / "out").glob("*.safetensors")):
        merged.update(load_file(file))
    assert len(list((tmp_path / "out").glob("*.safetensors"))) == 4, "64 MiB shards of 16 MiB tensors"
    assert merged.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(merged[name], value), name

"""``fullshard launch --num_processes 4`` with a config file that has Accelerate's ``parallelism_config`` section.

The script builds ``Accelerator()`` with no arguments: the launcher's ``PARALLELISM_CONFIG_*`` variables give it a
dp_shard=2 x tp=2 mesh. It makes TinyGPT's blocks tensor parallel over ``torch_device_mesh["tp"]``, trains two
steps, then trains torch's FSDP2 on the same mesh and batches; each rank prints its mesh, ranks and both losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

SRC = Path(__file__).resolve().parents[2] / "src"
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.utils.data import DataLoader, TensorDataset
    from fullshard import Accelerator
    from fullshard.testing.models import GPTConfig, TinyGPT

    cfg = GPTConfig()
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (16, cfg.block_size + 1), generator=g)
    dataset = TensorDataset(data[:, :-1], data[:, 1:])

    def model(tp_mesh):
        torch.manual_seed(0)
        m = TinyGPT(cfg)
        for block in m.blocks:
            parallelize_module(block, tp_mesh, {"fc": ColwiseParallel(use_local_output=False),
                                                "fc_out": RowwiseParallel()})
        return m

    accelerator = Accelerator()
    mesh = accelerator.torch_device_mesh
    net = model(mesh["tp"])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net, opt, loader = accelerator.prepare(net, opt, DataLoader(dataset, batch_size=2))
    ours = []
    for _, (x, y) in zip(range(2), loader):
        loss = net(x, y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        ours.append(loss.item())

    net = model(mesh["tp"])
    for block in net.blocks:
        fully_shard(block, mesh=mesh["dp_shard_cp"])
    fully_shard(net, mesh=mesh["dp_shard_cp"])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    dp = accelerator.process_index // 2
    theirs = []
    for _, (x, y) in zip(range(2), DataLoader(dataset, batch_size=4)):
        loss = net(x[2 * dp : 2 * dp + 2], y[2 * dp : 2 * dp + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        theirs.append(loss.item())
    row = {"rank": accelerator.process_index, "mesh": list(mesh.mesh_dim_names), "shape": list(mesh.shape),
           "tp_rank": accelerator.tensor_parallel_rank, "shard_rank": accelerator.data_parallel_shard_rank,
           "plugin_version": accelerator.fsdp_plugin.fsdp_version, "ours": ours, "theirs": theirs}
    sys.stdout.write("ROW " + json.dumps(row) + "\\n")
    sys.stdout.flush()
    accelerator.end_training()
    """
)


def test_launch_with_a_parallelism_config_section(tmp_path: Path) -> None:
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "num_processes": 4,
        "use_cpu": True,
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "Block",
        },
        "parallelism_config": {
            "parallelism_config_dp_replicate_size": 1,
            "parallelism_config_dp_shard_size": 2,
            "parallelism_config_tp_size": 2,
            "parallelism_config_cp_size": 1,
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "train.py").write_text(SCRIPT)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_"))}
    child_env.update(PYTHONPATH=str(SRC), FULLSHARD_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    config_file, script = str(tmp_path / "config.yaml"), str(tmp_path / "train.py")
    args = ["launch", "--config_file", config_file, "--num_processes", "4", script]
    result = subprocess.run([sys.executable, "-m", "fullshard.cli.main", *args], env=child_env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = sorted((json.loads(line[4:]) for line in result.stdout.splitlines() if line.startswith("ROW ")),
                  key=lambda row: row["rank"])  # fmt: skip
    assert [row["rank"] for row in rows] == [0, 1, 2, 3]
    assert [(row["tp_rank"], row["shard_rank"]) for row in rows] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for row in rows:
        assert row["mesh"] == ["dp_shard", "tp"] and row["shape"] == [2, 2] and row["plugin_version"] == 2
        assert row["ours"] == pytest.approx(row["theirs"], abs=1e-5), row
    assert rows[0]["ours"] == rows[1]["ours"] != rows[2]["ours"]  # a tp group shares its batches

"""``fullshard verify`` and ``fullshard merge-weights`` on good and bad input: one-line errors, exit code 2."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fullshard.checkpoint import merge as merge_module
from fullshard.checkpoint import save_sharded
from fullshard.checkpoint.checksum import save_with_checksum
from fullshard.checkpoint.transaction import SaveTransaction
from fullshard.checkpoint.writer import write_sharded
from fullshard.cli.main import cli


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"layer{i}.weight": torch.randn(8, 4, generator=g) for i in range(4)}}
    return save_sharded(state, tmp_path / "pytorch_model_fsdp_0")


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output.strip()


def _one_line_error(code: int, output: str, *parts: str) -> None:
    assert code == 2, output
    assert len(output.splitlines()) == 1 and "Traceback" not in output, output
    for part in parts:
        assert part in output, output


def test_verify_good_and_truncated(ckpt: Path) -> None:
    code, output = _run("verify", str(ckpt))
    assert code == 0 and "OK" in output and "checksums" in output
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    _one_line_error(*_run("verify", str(ckpt)), f"{shard} is truncated ({shard.stat().st_size} bytes")  # as a load


def test_not_a_checkpoint_is_not_called_incomplete(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    for command in (
        ["merge-weights", str(tmp_path / "notes"), str(tmp_path / "out")],
        ["verify", str(tmp_path / "notes")],
    ):
        code, output = _run(*command)
        _one_line_error(code, output, "not a", str(tmp_path / "notes"))
        assert "incomplete" not in output
    _one_line_error(*_run("merge-weights", str(tmp_path / "nope"), str(tmp_path / "out")), "does not exist")


def test_a_file_in_the_way(ckpt: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    _one_line_error(*_run("merge-weights", str(ckpt), str(blocker)), f"'{blocker}' is a file")
    _one_line_error(*_run("merge-weights", str(ckpt), str(blocker / "out")), f"a file is in the way at '{blocker}'")


def test_read_only_output(ckpt: Path, tmp_path: Path) -> None:
    readonly = tmp_path / "ro"
    readonly.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs (needs root): {mounted.stderr.decode().strip()}")
    try:
        _one_line_error(*_run("merge-weights", str(ckpt), str(readonly / "out")), "cannot write", "Read-only")
    finally:
        subprocess.run(["umount", str(readonly)], check=False)


def test_failed_merge_leaves_no_output_under_final_names(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = merge_module._ShardedSource.tensor
    calls = []

    def failing(self: merge_module._ShardedSource, entry: merge_module._Entry) -> torch.Tensor:
        calls.append(entry.name)
        if len(calls) == 3:
            raise RuntimeError(f"reading {entry.name} failed")
        return real(self, entry)

    monkeypatch.setattr(merge_module._ShardedSource, "tensor", failing)
    out = tmp_path / "out"
    code, output = _run("merge-weights", str(ckpt), str(out))
    _one_line_error(code, output, "failed")
    assert not out.exists(), "no output folder, no model.safetensors and no .partial file is left"


def test_a_failed_merge_into_an_existing_folder_keeps_what_was_there(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    def failing(self: merge_module._ShardedSource, entry: merge_module._Entry) -> torch.Tensor:
        raise RuntimeError(f"reading {entry.name} failed")

    monkeypatch.setattr(merge_module._ShardedSource, "tensor", failing)
    _one_line_error(*_run("merge-weights", str(ckpt), str(out / "deeper" / "still")), "failed")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"], "the folders merge-weights made are gone"
    assert (out / "notes.txt").read_text() == "mine"


def test_a_merge_says_what_it_wrote_where_and_how_big(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, output = _run("merge-weights", str(ckpt), str(out))
    assert code == 0, output
    size = (out / "model.safetensors").stat().st_size
    assert output == f"wrote {out / 'model.safetensors'} ({size} bytes, {size / 1e6:.1f} MB)"


def test_a_merge_onto_a_full_disk_says_how_much_it_needs(tmp_path: Path) -> None:
    # - Set up: a 4 MB checkpoint and a 2 MB file system to merge it into
    state = {"model": {f"w{i}": torch.ones(256, 1024) for i in range(4)}}
    ckpt = save_sharded(state, tmp_path / "pytorch_model_fsdp_0")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(disk)], check=True)
    try:
        # - Run
        code, output = _run("merge-weights", str(ckpt), str(disk / "out"))
        # - Check: the message names the full disk, the bytes needed and free; nothing is left on the disk
        _one_line_error(code, output, "no space left on device (ENOSPC) writing", f"'{disk / 'out'}")
        found = re.search(r"it needs (\d+) bytes .*, (\d+) bytes \(.*\) are free there", output)
        assert found and int(found.group(1)) > 4 * 2**20 > 2 * 2**20 >= int(found.group(2)), output
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def _save_state_like(state: dict[str, object], folder: Path) -> None:
    """A checkpoint as save_state writes it (one rank): a model folder, a random states file, markers, manifest."""
    tx = SaveTransaction(folder, "test")
    tx.begin()
    for leaf, record in write_sharded(state, tx.staging / "pytorch_model_fsdp_0").items():
        tx.record(f"pytorch_model_fsdp_0/{leaf}", record)
    tx.record("random_states_0.pkl", save_with_checksum({"seed": 0}, tx.staging / "random_states_0.pkl"))
    tx.commit()


def test_a_folder_of_checkpoints_is_answered_with_the_list(tmp_path: Path) -> None:
    # - Set up: a project folder whose checkpoints/ holds checkpoint_0 and checkpoint_1 (and a plain file).
    project = tmp_path / "runs" / "x"
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        state = {"model": {"w": torch.randn(4, 4, generator=g)}}
        _save_state_like(state, project / "checkpoints" / f"checkpoint_{i}")
    (project / "checkpoints" / "notes.txt").write_text("x")
    latest = project / "checkpoints" / "checkpoint_1"
    # - Run / Check: both the project folder and its checkpoints/ list what they hold and name one to pass.
    for folder, prefix in ((project, "checkpoints/"), (project / "checkpoints", "")):
        code, output = _run("verify", str(folder))
        _one_line_error(code, output, f"'{folder}' is not a checkpoint; it holds 2: {prefix}checkpoint_0, "
                        f"{prefix}checkpoint_1.", f"Pass one of them, e.g. fullshard verify {latest}")  # fmt: skip
    code, output = _run("merge-weights", str(project), str(tmp_path / "out"))
    _one_line_error(code, output, f"e.g. fullshard merge-weights {latest / 'pytorch_model_fsdp_0'} OUTPUT_PATH")
    assert not (tmp_path / "out").exists()
    # A checkpoint itself is still verified as before.
    assert _run("verify", str(latest / "pytorch_model_fsdp_0"))[0] == 0

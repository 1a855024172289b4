"""save_state / load_state under faults: kills at chosen points, a full disk, bit rot, mixed saves, crafted pickles.

Each scenario checks that the previous checkpoint survives bitwise, that a partial save is never taken, and
that every refusal names the file and says what is wrong (the same on every rank).
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import signal
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from fullshard import Accelerator
from fullshard.checkpoint.checksum import ChecksumStream
from fullshard.checkpoint.folder import is_complete_checkpoint
from fullshard.checkpoint.names import CHECKPOINT_MANIFEST, FOLDER_MARKER
from fullshard.checkpoint.transaction import SaveTransaction
from fullshard.checkpoint.verify import verify_checkpoint
from fullshard.cli.main import cli
from fullshard.testing import RankFailure, WorkerPool
from tests.distributed.test_accelerator import PER_RANK, dataset, model_and_optimizer, plugin


def _train(steps: int, seed: int = 0, full: bool = False) -> tuple[Accelerator, Any, Any, Any]:
    accelerator = Accelerator(
        fsdp_plugin=plugin(2, state_dict_type="FULL_STATE_DICT" if full else "SHARDED_STATE_DICT")
    )
    model, optimizer, scheduler = accelerator.prepare(*model_and_optimizer(seed))
    for i in range(steps):
        x, y = dataset()[i * PER_RANK : (i + 1) * PER_RANK]
        accelerator.backward(model(x, y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return accelerator, model, optimizer, scheduler


def _install_kill(rank: int, kill: tuple[int, str, int] | None) -> None:
    """Make this rank kill itself with ``signal`` right after writing ``file`` (or between the commit's renames)."""
    if kill is None or kill[0] != rank:
        return
    _, point, sig = kill
    if point == "between-renames":
        real_replace = os.replace

        def replace(src: Any, dst: Any) -> None:
            real_replace(src, dst)
            if str(dst).endswith(".previous"):
                os.kill(os.getpid(), sig)

        os.replace = replace  # the worker dies with it
        return
    real_record = SaveTransaction.record

    def record(self: SaveTransaction, relative: str, rec: Any) -> None:
        real_record(self, relative, rec)
        if relative == point:
            os.kill(os.getpid(), sig)

    SaveTransaction.record = record  # type: ignore[method-assign]


def save_after(
    rank: int, world: int, folder: str, steps: int, kill: tuple[int, str, int] | None = None, full: bool = False
) -> Any:
    accelerator, model, _, scheduler = _train(steps, full=full)
    _install_kill(rank, kill)
    accelerator.save_state(folder)
    return accelerator.get_state_dict(model), scheduler.state_dict()


def load_each(rank: int, world: int, folders: list[str], verify: bool = False, full: bool = False) -> list[Any]:
    """Load each folder into a fresh run (another seed); the full model state dict, or the error message."""
    out = []
    for folder in folders:
        accelerator, model, _, scheduler = _train(0, seed=3, full=full)
        try:
            accelerator.load_state(folder, verify=verify)
        except (RuntimeError, FileNotFoundError, ValueError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
            continue
        out.append((accelerator.get_state_dict(model), scheduler.state_dict()))
    return out


def _same(got: Any, want: Any) -> bool:
    (model, sched), (want_model, want_sched) = got, want
    return (
        sched == want_sched
        and model.keys() == want_model.keys()
        and all(torch.equal(v, want_model[k]) for k, v in model.items())
    )


@pytest.fixture(scope="module")
def saved(pool2: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    root = tmp_path_factory.mktemp("saved")
    state = pool2.run(save_after, str(root / "ckpt"), 1)[0]
    return root / "ckpt", state


# --- kills ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kill",
    [
        (1, "optimizer_0/__1_0.distcp", signal.SIGKILL),  # rank 1, after its optimizer shard, mid-save
        (0, "scheduler.bin", signal.SIGTERM),  # rank 0, after the model and optimizer are all written
        (0, "between-renames", signal.SIGKILL),  # rank 0, after moving the old folder aside, before the new one
    ],
    ids=["rank1-sigkill-optimizer", "rank0-sigterm-scheduler", "rank0-sigkill-commit"],
)
def test_killed_save_leaves_the_previous_checkpoint(pool2: WorkerPool, tmp_path: Path, kill: Any) -> None:
    # - Set up: a complete checkpoint after 1 step
    folder = tmp_path / "ckpt"
    first = pool2.run(save_after, str(folder), 1)[0]
    # - Run: save again after 2 steps on fresh ranks, one of which kills itself at the chosen point
    dying = WorkerPool(2, timeout_s=120, grace_s=10)
    try:
        with pytest.raises((RankFailure, TimeoutError)):
            dying.run(save_after, str(folder), 2, kill)
    finally:
        dying.close()
    # - Check: the previous checkpoint loads bitwise (from ckpt.previous when killed between the renames)
    staging = tmp_path / "ckpt.incomplete"
    assert not is_complete_checkpoint(staging)
    assert _same(pool2.run(load_each, [str(folder)])[0][0], first)  # rank 0 holds the full state dict
    verify_checkpoint(folder if folder.exists() else tmp_path / "ckpt.previous")
    # - the next save into the same parent folder cleans up the partial save; a save to ckpt puts it back
    pool2.run(save_after, str(tmp_path / "other"), 1)
    assert not staging.exists()
    if kill[1] == "between-renames":
        pool2.run(save_after, str(folder), 1)
        assert folder.is_dir() and not (tmp_path / "ckpt.previous").exists()


def test_verify_says_what_load_state_does_when_only_the_previous_checkpoint_is_left(
    pool2: WorkerPool, tmp_path: Path, saved: tuple[Path, Any]
) -> None:
    # - Set up: a commit killed between its renames leaves only ckpt.previous
    folder = tmp_path / "ckpt"
    shutil.copytree(saved[0], tmp_path / "ckpt.previous")
    # - Run
    result = CliRunner().invoke(cli, ["verify", str(folder)])
    # - Check: verify checks what load_state would load, and says so; load_state loads it
    assert result.exit_code == 0, result.output
    assert (
        f"'{folder}' does not exist (a save was killed while replacing it); load_state('{folder}') loads the whole "
        f"previous checkpoint from '{folder}.previous'" in result.output
    )
    assert f"{folder}.previous: OK" in result.output
    assert _same(pool2.run(load_each, [str(folder)])[0][0], saved[1])


# --- a full disk ---------------------------------------------------------------------------------------------


def save_with_full_disk(rank: int, world: int, folder: str, failing_rank: int) -> str:
    """save_state where ``failing_rank``'s writes hit ENOSPC after 1 KB (as a full disk does)."""
    real_write = ChecksumStream.write

    def write(self: ChecksumStream, data: Any) -> int:
        if self.size > 1024:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(self.raw, "name", None))
        return real_write(self, data)

    if rank == failing_rank:
        ChecksumStream.write = write  # type: ignore[method-assign]
    try:
        save_after(rank, world, folder, 2)
    except RuntimeError as exc:
        return str(exc)
    finally:
        ChecksumStream.write = real_write  # type: ignore[method-assign]
    return "saved"


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_full_disk_in_process(pool2: WorkerPool, tmp_path: Path, saved: tuple[Path, Any], failing_rank: int) -> None:
    folder = Path(shutil.copytree(saved[0], tmp_path / "ckpt"))
    messages = pool2.run(save_with_full_disk, str(folder), failing_rank)
    for message in messages:  # every rank raises, naming the rank and the cause
        assert f"rank {failing_rank}: no space left on device (ENOSPC) writing '{tmp_path}/ckpt.incomplete/" in message
        assert re.search(r"it needs \d+ bytes .* \d+ bytes \(.*\) are free there", message), message
        assert f"The checkpoint at '{folder}' is unchanged. The partial save was removed." in message
    assert not (tmp_path / "ckpt.incomplete").exists()
    assert _same(pool2.run(load_each, [str(folder)])[0][0], saved[1])


def save_full_disk_message(rank: int, world: int, folder: str, full: bool) -> str:
    try:
        save_after(rank, world, folder, 2, full=full)
    except RuntimeError as exc:
        return str(exc)
    return "saved"


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full-state-dict"])
def test_full_disk_on_a_small_filesystem(pool2: WorkerPool, tmp_path: Path, full: bool) -> None:
    # - Set up: a complete checkpoint on a tmpfs with room for it, not for a second one beside it
    saved = tmp_path / "saved"
    state = pool2.run(save_after, str(saved), 1, None, full)[0]
    size = sum(p.stat().st_size for p in saved.rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    budget = (size * 16 // 10 // 4096 + 1) * 4096
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={budget}", "tmpfs", str(disk)], check=True)
    try:
        folder = Path(shutil.copytree(saved, disk / "ckpt"))
        # - Run: a real ENOSPC (with FULL_STATE_DICT torch.save reports it as "unexpected pos", the OSError
        #   in its __context__)
        messages = pool2.run(save_full_disk_message, str(folder), full)
        # - Check: every rank names the full disk, the file, the bytes needed and free; the old checkpoint loads
        for message in messages:
            assert f"no space left on device (ENOSPC) writing '{disk}/ckpt.incomplete/" in message, message
            found = re.search(r"it needs (\d+) bytes .*, (\d+) bytes \(.*\) are free there once the partial", message)
            assert found and int(found.group(1)) > 0 and int(found.group(2)) < budget, message
            assert "unexpected pos" not in message and "The partial save was removed." in message
        assert sorted(p.name for p in disk.iterdir()) == ["ckpt"], "no staging folder is left to fill the disk"
        assert _same(pool2.run(load_each, [str(folder)], False, full)[0][0], state)
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# --- damage found on load, by verify and by merge-weights ----------------------------------------------------


def _flip(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


def test_bit_rot_is_found_by_verify_load_and_merge(pool2: WorkerPool, tmp_path: Path, saved: tuple[Path, Any]) -> None:
    folder = Path(shutil.copytree(saved[0], tmp_path / "ckpt"))
    assert CliRunner().invoke(cli, ["verify", str(folder)]).exit_code == 0
    bad = folder / "pytorch_model_fsdp_0" / "__1_0.distcp"
    _flip(bad)
    result = CliRunner().invoke(cli, ["verify", str(folder)])
    assert result.exit_code == 2 and f"{bad} is corrupt: the bytes of " in result.output  # as a load says it
    assert len(result.output.strip().splitlines()) == 1
    merged = CliRunner().invoke(
        cli, ["merge-weights", "--verify", str(folder / "pytorch_model_fsdp_0"), str(tmp_path / "o")]
    )
    assert merged.exit_code == 2 and f"{bad} is corrupt" in merged.output and not (tmp_path / "o").exists()
    for (message,) in pool2.run(load_each, [str(folder)], True):
        assert message.startswith(f"CheckpointDamagedError: {bad} is corrupt: the bytes of ")


@pytest.mark.parametrize(
    ("part", "refusal"),
    [
        ("pytorch_model_fsdp_0/__1_0.distcp", "the bytes of "),  # sharded: checked item by item as it loads
        ("optimizer_0/__0_0.distcp", "the bytes of "),
        ("scheduler.bin", "its CRC-32 is "),  # plain files: checked whole before anything loads
        ("random_states_1.pkl", "its CRC-32 is "),  # read by rank 1 only; rank 0 refuses too
    ],
)
def test_a_flipped_byte_is_refused_by_load_state_without_verify(
    pool2: WorkerPool, tmp_path: Path, saved: tuple[Path, Any], part: str, refusal: str
) -> None:
    # A file of the right size with one byte changed: before checked reads it loaded as wrong weights, silently.
    folder = Path(shutil.copytree(saved[0], tmp_path / "ckpt"))
    bad = folder / part
    _flip(bad, count=1)
    for (message,) in pool2.run(load_each, [str(folder)]):  # every rank raises, whichever rank read the byte
        assert message.startswith(f"CheckpointDamagedError: {bad} is corrupt: {refusal}"), message
        if refusal == "the bytes of ":
            assert "were saved with 0x" in message and message.endswith("load a good checkpoint before training on.")


def load_rows(rank: int, world: int, folder: str) -> tuple[str, torch.Tensor | None]:
    """Load ``folder``'s one-chunk ``w`` as a ``Shard(0)`` DTensor: each rank reads only its rows of the item."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fullshard.checkpoint import load_sharded
    from fullshard.checkpoint.verify import CheckpointDamagedError

    state = {"w": distribute_tensor(torch.zeros(8, 64), init_device_mesh("cpu", (world,)), [Shard(0)])}
    try:
        load_sharded(state, folder)
    except CheckpointDamagedError as exc:
        return str(exc), None
    return "loaded", state["w"].to_local()


@pytest.mark.parametrize("row", [1, 6])  # in rank 0's rows, in rank 1's
def test_a_flipped_byte_is_refused_by_a_resharded_load_that_reads_part_of_an_item(
    pool2: WorkerPool, tmp_path: Path, row: int
) -> None:
    from fullshard.checkpoint import save_sharded

    weight = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64)
    folder = save_sharded({"w": weight}, tmp_path / "one_rank")  # one chunk of 8 rows; 2 ranks read 4 each
    for rank, (message, rows) in enumerate(pool2.run(load_rows, str(folder))):
        assert message == "loaded" and torch.equal(rows, weight[4 * rank : 4 * rank + 4])
    path = folder / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    where = bytes(data).find(weight[row].numpy().tobytes()) + 4 * 17
    data[where] ^= 0x01
    path.write_bytes(bytes(data))
    for message, rows in pool2.run(load_rows, str(folder)):  # the rank that never read the row refuses too
        assert rows is None and message.startswith(f"{path} is corrupt: the bytes of 'w' "), message


def test_a_flipped_byte_in_a_full_state_dict_file_is_refused(pool2: WorkerPool, tmp_path: Path) -> None:
    folder = tmp_path / "full"
    pool2.run(save_after, str(folder), 1, None, True)
    files = sorted(folder.glob("*.bin"))
    assert {p.name for p in files} >= {"pytorch_model_fsdp.bin", "optimizer.bin", "scheduler.bin"}, files
    for bad in files:
        good = bad.read_bytes()
        _flip(bad, count=1)
        for (message,) in pool2.run(load_each, [str(folder)], False, True):
            assert message.startswith(f"CheckpointDamagedError: {bad} is corrupt: its CRC-32 is "), message
        bad.write_bytes(good)
    (loaded,) = pool2.run(load_each, [str(folder)], False, True)[0]
    assert not isinstance(loaded, str), loaded


def test_damage_is_named_without_verify(pool2: WorkerPool, tmp_path: Path, saved: tuple[Path, Any]) -> None:
    # - Set up: one copy per kind of damage
    cases: dict[str, Path] = {}
    for name in ("truncated", "no_metadata", "mixed", "evil_scheduler", "evil_rng"):
        cases[name] = Path(shutil.copytree(saved[0], tmp_path / name))
    sched = cases["truncated"] / "scheduler.bin"
    sched.write_bytes(sched.read_bytes()[:100])
    (cases["no_metadata"] / "pytorch_model_fsdp_0" / ".metadata").unlink()
    other = tmp_path / "other"
    pool2.run(save_after, str(other), 2)  # another save: its optimizer folder is copied into "mixed"
    shutil.rmtree(cases["mixed"] / "optimizer_0")
    shutil.copytree(other / "optimizer_0", cases["mixed"] / "optimizer_0")

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("echo pwned",))

    for name, file in (("evil_scheduler", "scheduler.bin"), ("evil_rng", "random_states_1.pkl")):
        (cases[name] / CHECKPOINT_MANIFEST).unlink()  # as in a checkpoint written by Accelerate: no checksums
        for marker in cases[name].glob(f"*/{FOLDER_MARKER}"):  # (a marker left would show that fullshard wrote it)
            marker.unlink()
        protocol = pickle.HIGHEST_PROTOCOL if name == "evil_rng" else 2  # torch's loader words these two apart
        torch.save({"x": Evil()}, cases[name] / file, pickle_protocol=protocol)
    # - Run: load each on 2 ranks
    results = pool2.run(load_each, [str(p) for p in cases.values()])
    # - Check: the same error on every rank, naming the file and what is wrong
    for per_rank in zip(*results, strict=True):
        assert per_rank[0] == per_rank[1]
    got = dict(zip(cases, results[0], strict=True))
    assert got["truncated"].startswith(f"CheckpointDamagedError: {sched} is 100 bytes, but .fullshard_checkpoint.json")
    metadata = cases["no_metadata"] / "pytorch_model_fsdp_0" / ".metadata"
    assert (
        got["no_metadata"]
        == f"FileNotFoundError: {metadata} is missing: the checkpoint in {metadata.parent} is incomplete; re-save it."
    )
    assert got["mixed"].startswith(
        f"CheckpointDamagedError: {cases['mixed']}: its parts come from different saves: 'optimizer_0' is from save"
    )
    assert f"{cases['evil_scheduler'] / 'scheduler.bin'} was refused: it asks for posix.system" in got["evil_scheduler"]
    assert f"{cases['evil_rng'] / 'random_states_1.pkl'} was refused: it holds more than tensors" in got["evil_rng"]
    assert "weights_only" not in got["evil_scheduler"] + got["evil_rng"]


def load_warned(rank: int, world: int, folder: str) -> tuple[Any, list[str]]:
    """``load_each`` of one folder, with the warnings this rank gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (result,) = load_each(rank, world, [folder])
    return result, [str(w.message) for w in caught if "records no checksums" in str(w.message)]


def test_an_unchecked_load_says_so_once_on_rank_0(pool2: WorkerPool, tmp_path: Path, saved: tuple[Path, Any]) -> None:
    # - Set up: the checkpoint as Accelerate would have written it: no manifest, no markers
    folder = Path(shutil.copytree(saved[0], tmp_path / "ckpt"))
    (folder / CHECKPOINT_MANIFEST).unlink()
    for marker in folder.glob(f"*/{FOLDER_MARKER}"):
        marker.unlink()
    # - Run
    (loaded0, said0), (loaded1, said1) = pool2.run(load_warned, str(folder))
    # - Check: it loads the saved values, and says once, on rank 0 only, that nothing was checksummed
    assert _same(loaded0, saved[1]) and not isinstance(loaded1, str), loaded1  # rank 0 holds the full state dict
    assert len(said0) == 1 and said1 == [], (said0, said1)
    assert "written by Accelerate or a fullshard before 2026-11-23" in said0[0]

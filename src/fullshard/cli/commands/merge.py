"""``fullshard merge-weights CHECKPOINT_DIR OUTPUT_PATH``: one weights file from a sharded checkpoint.

Every error is one line on stderr naming what was wrong and what to do, with exit code 2 (no traceback):
see :func:`checkpoint_errors`; a failed merge leaves nothing behind that was not there before. On success it
prints each file it wrote, with its size. The helpers that ``verify`` shares live here too:
:func:`checkpoints_under` lists the checkpoints of a folder given in place of one.
"""

from __future__ import annotations

import errno
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from fullshard.checkpoint import (
    CHECKPOINT_MANIFEST,
    DCP_METADATA_FILE,
    model_folder_name,
)

__all__ = [
    "CheckpointCommandError",
    "checkpoint_errors",
    "checkpoints_under",
    "merge_command",
    "not_a_checkpoint_but_holds",
]


class CheckpointCommandError(click.ClickException):
    """A one-line error of a checkpoint command; exit code 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))  # one line, whatever the message held


def _os_error(exc: OSError) -> str:
    where = f"'{exc.filename}'" if exc.filename else "the output"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {where}: {exc.strerror}. Pass an output folder you can write to."
    if exc.errno == errno.ENOSPC:
        from fullshard.checkpoint import free_bytes, no_space_message

        return no_space_message(exc.filename, None, free_bytes(exc.filename or "."))
    if exc.errno in (errno.EEXIST, errno.ENOTDIR):
        return f"a file is in the way at {where}. Move it, or pass another output folder."
    return f"{exc.strerror or exc} ({where}). Check the path and try again."


@contextmanager
def checkpoint_errors() -> Iterator[None]:
    """Turn the errors of checkpoint code into :class:`CheckpointCommandError` (one line, exit code 2)."""
    from fullshard.checkpoint import CheckpointFileError, NoSpaceError

    try:
        yield
    except click.ClickException:
        raise
    except OSError as exc:
        if (isinstance(exc, FileNotFoundError) and exc.filename is None) or isinstance(exc, NoSpaceError):
            raise CheckpointCommandError(str(exc)) from None
        raise CheckpointCommandError(_os_error(exc)) from None
    except (ValueError, RuntimeError, CheckpointFileError) as exc:
        raise CheckpointCommandError(str(exc)) from None


_MARKS = (CHECKPOINT_MANIFEST, DCP_METADATA_FILE, "random_states_0.pkl")  # a folder holding one is a checkpoint
_PARTS = ("pytorch_model_fsdp", "optimizer")


def _is_checkpoint(folder: Path) -> bool:
    """A checkpoint folder, or a folder of sharded parts (``pytorch_model_fsdp_0``, ``optimizer_0``, ...)."""
    parts = any(p.name.startswith(_PARTS) for p in folder.iterdir() if p.is_dir())
    return parts or any((folder / mark).is_file() for mark in _MARKS)


def checkpoints_under(folder: str | Path) -> list[Path]:
    """The checkpoint folders directly in ``folder`` or in its ``checkpoints/`` (``checkpoint_<i>`` in the order
    of ``i``, then others by name); empty when ``folder`` is a checkpoint itself or holds none."""
    from fullshard.checkpoint import CHECKPOINTS_FOLDER, checkpoint_index  # here: their module imports torch's DCP

    root = Path(folder)
    if not root.is_dir() or _is_checkpoint(root):
        return []
    places = [root, root / CHECKPOINTS_FOLDER] if (root / CHECKPOINTS_FOLDER).is_dir() else [root]
    found = [sub for place in places for sub in place.iterdir() if sub.is_dir() and _is_checkpoint(sub)]
    return sorted(found, key=lambda p: (checkpoint_index(p) is None, checkpoint_index(p) or 0, str(p)))


def not_a_checkpoint_but_holds(
    folder: str | Path, command: str, *, sub: str = "", then: str = ""
) -> CheckpointCommandError | None:
    """The error for ``fullshard COMMAND FOLDER`` when FOLDER holds checkpoints rather than being one, else ``None``.

    It lists them (``(incomplete)`` after a ``checkpoint_<i>`` whose save did not finish) and suggests the latest
    complete one, followed by its subfolder ``sub`` when it has one and by ``then`` (the other arguments)."""
    from fullshard.checkpoint import checkpoint_index, is_complete_checkpoint  # here: they import torch's DCP

    root = Path(folder)
    found = checkpoints_under(root)
    if not found:
        return None
    complete = [p for p in found if checkpoint_index(p) is None or is_complete_checkpoint(p)]
    names = ", ".join(str(p.relative_to(root)) + ("" if p in complete else " (incomplete)") for p in found)
    pick = (complete or found)[-1]
    pick = pick / sub if sub and (pick / sub).is_dir() else pick
    return CheckpointCommandError(
        f"'{folder}' is not a checkpoint; it holds {len(found)}: {names}. Pass one of them, e.g. "
        f"fullshard {command} {pick}{then}"
    )


def _check_output(output: Path) -> None:
    """Fail before reading anything if OUTPUT_PATH cannot be a folder we write into."""
    if output.exists() and not output.is_dir():
        raise CheckpointCommandError(
            f"OUTPUT_PATH '{output}' is a file; merge-weights writes into a folder. Pass a folder, or move the file."
        )
    for parent in output.parents:
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointCommandError(
                    f"a file is in the way at '{parent}' (a folder of OUTPUT_PATH '{output}'). Move it, or pass "
                    "another output folder."
                )
            break
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=output):  # a read-only folder or file system fails here, not mid-merge
        pass


@click.command(
    "merge-weights",
    short_help="Merge a sharded FSDP checkpoint into one weights file.",
    epilog="Example: fullshard merge-weights runs/train_gpt/checkpoints/checkpoint_3/pytorch_model_fsdp_0 merged/",
)
@click.argument("checkpoint_dir", type=click.Path())
@click.argument("output_path", type=click.Path())
@click.option(
    "--unsafe_serialization",
    "--unsafe-serialization",
    "unsafe_serialization",
    is_flag=True,
    help="Write pytorch_model.bin (pickle) instead of model.safetensors.",
)
@click.option(
    "--remove_checkpoint_dir",
    "--remove-checkpoint-dir",
    "remove_checkpoint_dir",
    is_flag=True,
    help="Delete CHECKPOINT_DIR after merging.",
)
@click.option("--verify", is_flag=True, help="Check every file's checksum first (as `fullshard verify` does).")
def merge_command(
    checkpoint_dir: str, output_path: str, unsafe_serialization: bool, remove_checkpoint_dir: bool, verify: bool
) -> None:
    """Merge the shards in CHECKPOINT_DIR (a SHARDED_STATE_DICT model or optimizer folder, such as
    checkpoint_3/pytorch_model_fsdp_0) into model.safetensors (or pytorch_model.bin) in the folder OUTPUT_PATH.

    Exit code: 0 on success, 2 with one line saying what is wrong (given a folder that holds checkpoints, it
    lists them)."""
    try:  # imported here: it pulls in the checkpoint code, which the other commands do not need
        from fullshard.checkpoint import merge_fsdp_weights, new_folders, remove_new_folders, verify_checkpoint
    except ImportError as exc:
        raise click.ClickException(f"merge-weights is unavailable: {exc}. Reinstall fullshard.") from None

    output = Path(output_path)
    created = new_folders(output)
    try:
        with checkpoint_errors():
            if not Path(checkpoint_dir).is_dir():
                what = "is a file" if Path(checkpoint_dir).exists() else "does not exist"
                raise CheckpointCommandError(
                    f"CHECKPOINT_DIR '{checkpoint_dir}' {what}; pass a sharded checkpoint folder such as "
                    "ckpt/pytorch_model_fsdp_0."
                )
            model = model_folder_name(0)
            holds = not_a_checkpoint_but_holds(checkpoint_dir, "merge-weights", sub=model, then=" OUTPUT_PATH")
            if holds is not None:
                raise holds
            if verify:
                verify_checkpoint(checkpoint_dir)
            _check_output(output)
            files = merge_fsdp_weights(
                checkpoint_dir,
                output_path,
                safe_serialization=not unsafe_serialization,
                remove_checkpoint_dir=remove_checkpoint_dir,
            )
    except BaseException:
        remove_new_folders(created)  # a failed merge leaves nothing that was not there before
        raise
    _report(files, checkpoint_dir if remove_checkpoint_dir else None)


def _report(files: list[Path], removed: str | None) -> None:
    """What the merge wrote (each file, where, how big) and, with --remove_checkpoint_dir, what it deleted."""
    sizes = [path.stat().st_size for path in files]
    for path, size in zip(files, sizes, strict=True):
        click.echo(f"wrote {path} ({size} bytes, {size / 1e6:.1f} MB)")
    if len(files) > 1:
        click.echo(f"{len(files)} files, {sum(sizes)} bytes ({sum(sizes) / 1e6:.1f} MB) in total")
    if removed is not None:
        click.echo(f"removed {removed}")

"""A training folder saved in one call: its parts and small files written, then committed whole.

The caller says what goes into the folder (a :class:`TrainingFolder`: its model and optimizer :class:`Part` s, the
small files of each rank, the hooks that write into it first); this module says how, with one
:class:`~fullshard.checkpoint.transaction.SaveTransaction` (see [Note: whole-checkpoint commit] there):

- :func:`save_folder`: begin; the hooks; each part built (on every rank, outside a step: building a state dict
  may be a collective, which one failed rank must not skip) and written in a step of its own, so every rank
  learns of any rank's failure; the small files; commit. Returns when the folder is in place.
- :func:`start_save_folder`: the same, returning once every state is copied to host memory (sharded parts into
  the host buffers kept between background saves); the writes and the commit run in the background thread over
  its own process group (``background.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fullshard.checkpoint.background import buffers, host_copy, save_group
from fullshard.checkpoint.background import start as start_in_background
from fullshard.checkpoint.folder import check_output_dir
from fullshard.checkpoint.transaction import SaveTransaction
from fullshard.checkpoint.writer import local_nbytes

__all__ = ["Part", "TrainingFolder", "save_folder", "start_save_folder"]


@dataclass(frozen=True)
class Part:
    """A model or optimizer part: a sharded (DCP) subfolder every rank writes its shards into, or a file rank 0
    writes whole (the state ``build`` returns on the other ranks is not written)."""

    name: str
    sharded: bool
    build: Callable[[], dict[str, Any]]  # may be a collective: called on every rank, outside the steps


@dataclass(frozen=True)
class TrainingFolder:
    """What goes into a training folder, as its caller says."""

    parts: list[Part]
    small_files: Callable[[int], dict[str, Any]]  # this rank's small files (file name -> object), given the rank
    small_files_are: str  # what they are, for the error of a failed write ("the schedulers, ...")
    before: Callable[[Path], None] | None = None  # called with the staging folder first; what it writes is saved
    before_is: str = "the pre-save hooks"  # what ``before`` is, for the error of a failure


def _write_part(tx: SaveTransaction, part: Part, state: dict[str, Any]) -> None:
    if part.sharded:
        tx.write_sharded(part.name, state)
    elif tx.rank == 0:
        tx.write_file(part.name, state)


def _write_small_files(tx: SaveTransaction, states: dict[str, Any]) -> None:
    for name, state in states.items():
        tx.write_file(name, state)


def _begin(tx: SaveTransaction, folder: TrainingFolder) -> None:
    tx.begin()
    if folder.before is not None:
        tx.step(f"running {folder.before_is}", partial(folder.before, tx.staging))


def save_folder(output_dir: str | Path, where: str, folder: TrainingFolder) -> Path:
    """Write ``folder`` at ``output_dir`` as one atomic unit (a collective: every rank calls it); returns its path.

    On failure every rank raises and ``output_dir`` holds what it held before.
    """
    tx = SaveTransaction(check_output_dir(output_dir, where), where)
    _begin(tx, folder)
    for part in folder.parts:
        state = part.build()
        tx.step(f"writing {part.name}", partial(_write_part, tx, part, state), local_nbytes(state))
    tx.step(f"writing {folder.small_files_are}", lambda: _write_small_files(tx, folder.small_files(tx.rank)))
    return tx.commit()


def start_save_folder(
    output_dir: str | Path,
    where: str,
    folder: TrainingFolder,
    after: Callable[[Path, dist.ProcessGroup | None], None] | None = None,
) -> Path:
    """:func:`save_folder` that returns once this rank's state is copied to host memory (a collective).

    The writes, the commit and then ``after(folder, process_group)`` run in the background thread; the caller
    waits for it with ``background.wait()``, which raises its failure. ``folder.before`` runs before this returns.
    """
    tx = SaveTransaction(check_output_dir(output_dir, where), where, save_group())
    _begin(tx, folder)
    parts = folder.parts

    def copy_to_host(states: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        # Sharded parts go into the host buffers of the previous background save (same keys, shapes and dtypes),
        # kept until released: the caller waited for the write that read them.
        kept = buffers()
        kept.begin()
        copies = [
            host_copy(st, kept=kept, key=(part.name,)) if part.sharded else copy.deepcopy(st)
            for part, st in zip(parts, states, strict=True)
        ]
        kept.finish()
        return copies, copy.deepcopy(folder.small_files(tx.rank))

    # The built state dicts are views of the live parameters and optimizer state: dropped once copied.
    copies, small = tx.step("copying the state to host memory", partial(copy_to_host, [p.build() for p in parts]))

    def write_and_commit() -> None:
        for part in parts:
            state = copies.pop(0)  # the references to the host copy are dropped once written (buffers stay kept)
            tx.step(f"writing {part.name}", partial(_write_part, tx, part, state), local_nbytes(state))
            del state
        tx.step(f"writing {folder.small_files_are}", partial(_write_small_files, tx, small))
        tx.commit()
        if after is not None:
            after(tx.target, tx.process_group)

    start_in_background(write_and_commit, where)
    return tx.target

"""Check a checkpoint before trusting it: ``fullshard verify``, ``load_state(verify=True)``, ``merge-weights --verify``.

Two levels:

- :func:`check_parts` (cheap, run by every ``load_state``): with a manifest, every file it lists is present
  with its recorded size, no part that ``load_state`` reads is missing from it, and every sharded subfolder's
  marker carries the manifest's ``save_id`` (a folder copied in from another save is named). Without one
  (Accelerate, older fullshard), the subfolders' markers, if any, must agree on their ``save_id``.
- :func:`verify_checkpoint` (reads every byte): the above, plus every file's CRC-32 against the one recorded
  when it was written, every sharded folder's ``.metadata`` against its data files (each file present and
  long enough), and every saving rank's files present (``random_states_<r>.pkl``, ``__<r>_0.distcp``).

Both raise :class:`CheckpointDamagedError` naming the first bad file (in sorted order) and what is wrong,
or :class:`NotACheckpointError` for a folder that holds no checkpoint at all.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from fullshard.checkpoint.boundary import entry_path
from fullshard.checkpoint.checksum import file_checksum
from fullshard.checkpoint.errors import CheckpointDamagedError, NotACheckpointError
from fullshard.checkpoint.folder import (
    FolderState,
    check_sizes,
    checkpoint_state,
    folder_to_load,
    missing_message,
    staging_error,
)
from fullshard.checkpoint.manifest import Manifest, read_folder_marker, read_manifest
from fullshard.checkpoint.names import (
    CHECKPOINT_MANIFEST,
    DCP_METADATA_FILE,
    FOLDER_MARKER,
    dcp_shard_file_name,
    is_load_state_part,
    rng_state_file_name,
)
from fullshard.checkpoint.reader import check_data_files, read_metadata

__all__ = ["CheckpointDamagedError", "NotACheckpointError", "VerifyReport", "check_parts", "verify_checkpoint"]


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_checkpoint` checked."""

    folder: Path
    files: int
    bytes: int
    checksummed: bool  # False for checkpoints written without checksums (Accelerate, older fullshard)
    save_id: str | None
    note: str = ""  # what load_state would do differently (it falls back to ``<folder>.previous``)


def _dcp_folders(root: Path) -> list[Path]:
    subs = [p for p in root.iterdir() if p.is_dir() and ((p / DCP_METADATA_FILE).exists() or any(p.glob("*.distcp")))]
    return sorted(entry_path(root, p.name) for p in subs)  # a linked subfolder is refused, not read


def _describe(root: Path) -> tuple[Manifest | None, bool]:
    """The manifest (or a single sharded folder's marker) and whether ``root`` is itself a sharded folder."""
    manifest = read_manifest(root)
    if manifest is not None:
        return manifest, False
    single = (root / DCP_METADATA_FILE).exists() or any(root.glob("*.distcp"))
    return (read_folder_marker(root) if single else None), single


def _check_listed(root: Path, manifest: Manifest) -> None:
    check_sizes(root, manifest.files, manifest.path.name)


def _check_unlisted(root: Path, manifest: Manifest) -> None:
    listed = set(manifest.files)
    for entry in sorted(root.iterdir()):
        if not is_load_state_part(entry.name):
            continue
        names = [entry.name] if entry.is_file() else [
            f"{entry.name}/{p.name}" for p in sorted(entry.iterdir()) if p.is_file() and p.name != FOLDER_MARKER
        ]  # fmt: skip
        for name in names:
            if name not in listed:
                raise CheckpointDamagedError(
                    f"{root / name} is not part of save {manifest.save_id} ({manifest.path} does not list it): "
                    "it comes from another save. Remove it, or load another checkpoint."
                )


def _check_save_ids(root: Path, manifest: Manifest | None) -> None:
    ids = {}
    for sub in _dcp_folders(root):
        marker = read_folder_marker(sub)
        if marker is not None and marker.save_id is not None:
            ids[sub.name] = marker.save_id
    expected = manifest.save_id if manifest is not None else None
    if expected is not None:
        foreign = {name: sid for name, sid in ids.items() if sid != expected}
        if foreign:
            name, sid = sorted(foreign.items())[0]
            raise CheckpointDamagedError(
                f"{root}: its parts come from different saves: '{name}' is from save {sid}, the checkpoint "
                f"({CHECKPOINT_MANIFEST}) from save {expected}. Load another checkpoint, or re-save."
            )
    elif len(set(ids.values())) > 1:
        listed = ", ".join(f"'{name}' from save {sid}" for name, sid in sorted(ids.items()))
        raise CheckpointDamagedError(
            f"{root}: its parts come from different saves ({listed}). Load another checkpoint, or re-save."
        )


def check_parts(folder: str | os.PathLike[str]) -> Manifest | None:
    """The cheap checks every ``load_state`` runs (see the module docstring); returns the manifest if any."""
    root = Path(folder)
    manifest = read_manifest(root)
    _check_save_ids(root, manifest)  # first: a part copied from another save is named as such
    if manifest is not None:
        _check_listed(root, manifest)
        _check_unlisted(root, manifest)
    return manifest


def check_file(path: Path, manifest: Manifest | None) -> None:
    """Read ``path`` whole and raise :class:`CheckpointDamagedError` if its CRC-32 is not the one ``manifest``
    records for it (nothing to check without a manifest, or for a file it lists without a checksum)."""
    record = manifest.files.get(path.relative_to(manifest.path.parent).as_posix()) if manifest is not None else None
    if record is None or record.crc32 is None:
        return
    actual = file_checksum(path)
    if actual.crc32 != record.crc32:
        raise CheckpointDamagedError(
            f"{path} is corrupt: its CRC-32 is {actual.crc32:08x}, but it was written with "
            f"{record.crc32:08x} ({manifest.path.name}). Load another checkpoint, or re-save."
        )


def _check_ranks(root: Path, manifest: Manifest, single: bool) -> None:
    world = manifest.world_size
    expected = [] if single else [rng_state_file_name(r) for r in range(world)]
    folders = [root] if single else [p for p in _dcp_folders(root)]
    for sub in folders:
        prefix = "" if single else f"{sub.name}/"
        expected += [f"{prefix}{dcp_shard_file_name(r)}" for r in range(world)]
    for name in expected:
        if name not in manifest.files:
            raise CheckpointDamagedError(
                f"{root / name} is missing (the save had {world} ranks; the manifest {manifest.path} lacks this "
                "rank's file): the checkpoint is incomplete. Load another checkpoint."
            )


def _check_dcp(folder: Path) -> None:
    if not (folder / DCP_METADATA_FILE).is_file():
        raise CheckpointDamagedError(missing_message(folder / DCP_METADATA_FILE))
    try:
        check_data_files(folder, read_metadata(folder))
    except (FileNotFoundError, RuntimeError) as exc:
        raise CheckpointDamagedError(str(exc)) from None


def _not_a_checkpoint(root: Path) -> NotACheckpointError:
    if not root.exists():
        return NotACheckpointError(f"'{root}' does not exist; pass the folder save_state or save_sharded wrote.")
    if not root.is_dir():
        return NotACheckpointError(f"'{root}' is a file, not a checkpoint folder; pass the folder save_state wrote.")
    return NotACheckpointError(
        f"'{root}' is not a checkpoint: it holds no {CHECKPOINT_MANIFEST}, no {DCP_METADATA_FILE} and no "
        f"{rng_state_file_name(0)}. Pass the folder save_state wrote (or one of its "
        "pytorch_model_fsdp_<i>/optimizer_<i>)."
    )


def verify_checkpoint(folder: str | os.PathLike[str], *, share: tuple[int, int] | None = None) -> VerifyReport:
    """Check every file of a checkpoint; raise :class:`CheckpointDamagedError` naming the first bad one.

    ``folder`` is a ``save_state`` folder or one sharded (DCP) folder. ``share=(rank, world)`` computes the
    checksums of only every ``world``-th file starting at ``rank`` (the other checks run in full), so that the
    ranks of a ``load_state(verify=True)`` split the reading between them.
    """
    root = Path(folder)
    state = checkpoint_state(root)
    if state is FolderState.PREVIOUS_ONLY:  # say what load_state would do: load the previous checkpoint
        loaded = folder_to_load(root)
        note = (
            f"'{root}' does not exist (a save was killed while replacing it); load_state('{root}') loads the "
            f"whole previous checkpoint from '{loaded}' with a warning, and the next save_state puts it back"
        )
        return dataclasses.replace(verify_checkpoint(loaded, share=share), note=note)  # fmt: skip
    if not root.is_dir():
        raise _not_a_checkpoint(root)
    if state is FolderState.STAGING:
        raise staging_error(root)
    manifest, single = _describe(root)
    if manifest is None and not single and not (root / rng_state_file_name(0)).is_file() and not _dcp_folders(root):
        raise _not_a_checkpoint(root)
    if single:
        if manifest is not None:
            _check_listed(root, manifest)
    else:
        check_parts(root)
    if manifest is not None:
        _check_ranks(root, manifest, single)
        rank, world = share or (0, 1)
        for i, (name, record) in enumerate(sorted(manifest.files.items())):
            if i % world != rank or record.crc32 is None:
                continue
            check_file(root / name, manifest)
    for sub in [root] if single else _dcp_folders(root):
        _check_dcp(sub)
    files = manifest.files if manifest is not None else {}
    checksummed = manifest is not None and all(r.crc32 is not None for r in files.values())
    return VerifyReport(root, len(files), sum(r.size for r in files.values()), checksummed,
                        manifest.save_id if manifest else None)  # fmt: skip
